"""A ``regex`` constraint means the same under both grammar backends (grammar_backend.regex_dialect)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from grammar_backend.compile import compile_spec
from grammar_backend.errors import CompileError, ConstraintError
from grammar_backend.llg import LlgBackend
from grammar_backend.regex_dialect import misplaced_anchor, portable_regex
from grammar_backend.spec import parse_constraint
from grammar_backend.tokenizer import TokenizerBundle, load_tokenizer
from standins.tiny_model import TinyModelInfo

DOT = "[^\\n\\r\u2028\u2029]"
SPACE = "\\t\\n\\x0b\\x0c\\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"

#: (pattern, what portable_regex writes)
REWRITES = [
    (r"\d+", "[0-9]+"),
    (r"\D", "[^0-9]"),
    (r"\w", "[0-9A-Za-z_]"),
    (r"\W", "[^0-9A-Za-z_]"),
    (r"\s", f"[{SPACE}]"),
    (r"\S", f"[^{SPACE}]"),
    (r"a.b", f"a{DOT}b"),
    (r"[.\d]", "[.0-9]"),  # '.' in a class is a member
    (r"[^\s]", f"[^{SPACE}]"),
    (r"[\w-.]+", "[0-9A-Za-z_\\-.]+"),  # a class escape is no range end: the '-' beside it is escaped
    (r"[.-\d]", "[.\\-0-9]"),
    (r"[a-z\d-]", "[a-z0-9\\-]"),
    (r"[]a.]", "[]a.]"),  # ']' first is a member
    (r"[^].]", "[^].]"),
    (r"\\d\.", r"\\d\."),  # an escaped backslash, then 'd'; an escaped dot
    (r"\p{L}\x41\u0042", r"\p{L}\x41\u0042"),
    (r"(?:\W|x)", "(?:[^0-9A-Za-z_]|x)"),
    # A negated shorthand in a class: an alternation of classes.
    (r"[\s\S]*", f"(?:[{SPACE}]|[^{SPACE}])*"),  # JavaScript's any-character idiom
    (r"x[\D]y", "x(?:[^0-9])y"),
    (r"[a\S-z]", f"(?:[a\\-z]|[^{SPACE}])"),  # \S gone, its '-' is still no range
    (r"[^\S]", f"[{SPACE}]"),
]


@pytest.mark.parametrize(("pattern", "written"), REWRITES, ids=[p for p, _ in REWRITES])
def test_the_rewrite(pattern: str, written: str) -> None:
    assert portable_regex(pattern) == written
    assert portable_regex(written) == written  # idempotent: the wire form may be parsed again


@pytest.mark.parametrize(("pattern", "escape", "offset"), [(r"[^a\D]", "D", 3), (r"[^\W\s]", "W", 2),
                                                        (r"x[^\S.]", "S", 3)])
def test_a_negated_shorthand_beside_other_members_of_a_negated_class_is_refused(pattern: str, escape: str,
                                                                                offset: int) -> None:
    with pytest.raises(ConstraintError, match=rf"^grammar: regex: \\{escape} inside a negated character class "
                                              rf"beside other members \(offset {offset}\) cannot be written"):
        portable_regex(pattern)
    with pytest.raises(ConstraintError, match=rf"\\{escape} inside a negated character class"):
        parse_constraint("regex", pattern)


@pytest.fixture(scope="module")
def bundle(tiny: TinyModelInfo) -> TokenizerBundle:
    return load_tokenizer(tiny.path)


@pytest.fixture(scope="module")
def matchers(bundle: TokenizerBundle) -> Callable[[str], dict[str, Any]]:
    """Per pattern, a new matcher of each backend as served."""
    compiler = xgr.GrammarCompiler(bundle.info, max_threads=1)
    llg = LlgBackend(bundle.hf, bundle.info.vocab_size, sorted(int(t) for t in bundle.info.stop_token_ids))

    def make(pattern: str) -> dict[str, Any]:
        spec = parse_constraint("regex", pattern)
        served, compiled = compile_spec(compiler, spec), llg.compile(spec)
        return {"xgrammar": xgr.GrammarMatcher(served), "llguidance": llg.matcher(compiled)}

    return make


#: (pattern, text, a full match under ECMA-262)
MEANINGS = [
    (r"\d{2}", "12", True),
    (r"\d{2}", "١٢", False),  # Arabic-Indic digits: llguidance alone took them
    (r"\d{2}", "１２", False),
    (r"\D", "٣", True),
    (r"\D", "3", False),
    (r"\w+", "aZ_9", True),
    (r"\w+", "é", False),  # llguidance alone took it
    (r"a.b", "a\tb", True),
    (r"a.b", "aéb", True),
    (r"a.b", "a\nb", False),  # xgrammar alone took it
    (r"a.b", "a\rb", False),
    (r"a.b", "a\u2028b", False),
    (r"\s", "\ufeff", True),
    (r"\s", "\u3000", True),
    (r"\s", "\u0085", False),
    (r"\S", " ", False),
    (r"[\w-.]+", "a-.b", True),
    (r"[\w-.]+", "a,b", False),
    (r"[^\d]", "5", False),
    (r"[\s\d]+", "1 2", True),
    (r"a[\s\S]*b", "a\nx b", True),
    (r"[\S]+", "a b", False),
    (r"x[\D]y", "x٣y", True),
    (r"x[\D]y", "x3y", False),
    (r"[a\S-z]", "-", True),
    (r"[a\S-z]", " ", False),
    (r"[^\S]", " ", True),
]


@pytest.mark.parametrize(("pattern", "text", "matches"), MEANINGS, ids=[f"{p}-{t!r}" for p, t, _ in MEANINGS])
def test_both_backends_read_the_ecma_meaning(matchers: Callable[[str], dict[str, Any]], bundle: TokenizerBundle,
                                             pattern: str, text: str, matches: bool) -> None:
    stop = int(bundle.info.stop_token_ids[0])
    for backend, matcher in matchers(pattern).items():
        taken = all(matcher.accept_token(t) for t in bundle.hf.encode(text, add_special_tokens=False))
        assert (taken and matcher.accept_token(stop)) is matches, backend


#: (pattern, offset of the anchor xgrammar would drop to its harm, or None)
ANCHORS = [
    (r"^a$", None),
    (r"^$|^\d+$", None),
    (r"(^a|b)c", None),
    (r"^(a|b$)", None),
    (r"\^a\$", None),  # escaped: literals
    (r"[$^]", None),  # class members
    (r"a$b", 1),
    (r"x(^a)", 2),
    (r"^(a($|/))*$", 4),
    (r"(a$)*", 2),  # repeated: the second round would start after the end
    (r"(?:^a|^b)$", 6),  # harmless in fact, refused as the rule is kept simple: top-level alternatives only
    (r"[a]^b", 3),
]


@pytest.mark.parametrize(("pattern", "offset"), ANCHORS, ids=[p for p, _ in ANCHORS])
def test_anchors_xgrammar_would_drop(pattern: str, offset: int | None) -> None:
    assert misplaced_anchor(pattern) == offset


def test_xgrammar_refuses_a_pattern_whose_anchor_it_would_drop(bundle: TokenizerBundle) -> None:
    compiler = xgr.GrammarCompiler(bundle.info, max_threads=1)
    spec = parse_constraint("regex", r"^(a($|/))*$")
    with pytest.raises(CompileError, match=r"^grammar: xgrammar would drop the '\$' at offset 4 of this regex and "
                                           r"admit text the pattern does not; choose backend llguidance for it$"):
        compile_spec(compiler, spec)
    # What it dropped before: its own compile admits "aa", which the pattern does not.
    matcher = xgr.GrammarMatcher(compiler.compile_regex(spec.payload))
    assert all(matcher.accept_token(t) for t in bundle.hf.encode("aa", add_special_tokens=False))
    assert compile_spec(compiler, parse_constraint("regex", r"^$|^\d+$")) is not None


FUZZ_PATTERNS = [r"\d{6}", r"(\w|-){4}", r"a.{3}b", r"[\s\S]{2}x", r"^$|^[0-9]+(\.\d+)?$"]


def test_random_walks_fully_match_the_ecma_meaning(monkeypatch: pytest.MonkeyPatch, bundle: TokenizerBundle) -> None:
    """``bench/regex_fuzz.py`` on a few patterns: every closed output of both served backends fully matches
    the pattern as ECMA-262 reads it; llguidance's own compile, walked the same way, does not (\\d, \\w)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is not a package
    import regex_fuzz

    tallies = regex_fuzz.fuzz(FUZZ_PATTERNS, bundle, walks=12, max_steps=20, seed=0)
    served, llg, raw_x, raw_l = (tallies[g] for g in regex_fuzz.GRAMMARS)
    assert (served.schemas, llg.schemas, raw_x.schemas, raw_l.schemas) == (5, 5, 5, 5)
    assert served.closed >= 48 and llg.closed >= 48, (served.closed, llg.closed)  # of 60 walks
    assert (served.failed, llg.failed, served.limits, llg.limits, served.mismatches, llg.mismatches) == (0,) * 6, \
        (served.examples, llg.examples)
    assert raw_l.failed > 0
