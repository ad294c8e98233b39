"""Does every closed ``regex`` output fully match its pattern, read as ECMA-262 reads it?  Random walks, both backends.

The patterns are the ``pattern`` keywords of a MaskBench folder's schemas,
each served as a ``regex`` constraint.  A walk takes up to ``--max-steps``
tokens its mask allows (uniformly, never the stop token), then
:class:`grammar_backend.closing.Closer` completes it as ``on_budget: close``
does (:class:`json_fuzz.Walker`).  The check: ``re.fullmatch`` of the
pattern after :func:`grammar_backend.regex_dialect.portable_regex`, which
writes ``.``, ``\\d``, ``\\w`` and ``\\s`` out with ECMA-262's meaning in
syntax Python's ``re`` reads the same way, so the check is the contract's
meaning rather than Python's.  A pattern Python's ``re`` cannot compile is
skipped.

Four grammars per pattern: xgrammar and llguidance as served
(``grammar_backend``), and each backend's own compile of the pattern as the
client wrote it (the reference that shows what the walks catch).
``mask/accept mismatches`` counts walks where a matcher refused a token its own
mask allowed (a backend defect; served, it fails that request's step).

Usage (from the repository root)::

    .venv/bin/python bench/regex_fuzz.py ../shared/data/maskbench-dev      # 550 patterns, ~1 min

The last line reads ``closed regex outputs not a full match: xgrammar A/B,
llguidance C/D; unmended: xgrammar E/F, llguidance G/H``.  Nothing here
asserts; ``tests/unit/test_regex_dialect.py`` runs :func:`fuzz` on a few
patterns.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
import llguidance
import xgrammar as xgr
from json_fuzz import Tally, Walker

from grammar_backend.bitmask import Matcher
from grammar_backend.compile import compile_spec
from grammar_backend.errors import ServingError
from grammar_backend.llg import LlgMatcher
from grammar_backend.regex_dialect import portable_regex
from grammar_backend.spec import parse_constraint
from grammar_backend.tokenizer import TokenizerBundle, load_tokenizer

#: The grammars walked per pattern, in report order.
GRAMMARS: Final = ("xgrammar", "llguidance", "xgrammar unmended", "llguidance unmended")


def patterns_of(node: Any) -> Iterator[str]:
    """Every ``pattern`` keyword's string in a schema (and in anything nested in it)."""
    if isinstance(node, dict):
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        for value in node.values():
            yield from patterns_of(value)
    elif isinstance(node, list):
        for value in node:
            yield from patterns_of(value)


def _matchers(walker: Walker, pattern: str) -> dict[str, Callable[[], Matcher] | None]:
    """A new-matcher factory per grammar; None where that grammar refuses the pattern."""
    out: dict[str, Callable[[], Matcher] | None] = dict.fromkeys(GRAMMARS)
    spec = parse_constraint("regex", pattern)
    llg = walker.llg
    try:
        served = compile_spec(walker.compiler, spec)
        out["xgrammar"] = lambda: xgr.GrammarMatcher(served)
    except ServingError:
        pass
    try:
        compiled = llg.compile(spec)
        out["llguidance"] = lambda: llg.matcher(compiled)
    except ServingError:
        pass
    try:
        raw = walker.compiler.compile_regex(pattern)
        out["xgrammar unmended"] = lambda: xgr.GrammarMatcher(raw)
    except RuntimeError:
        pass
    template = llguidance.LLMatcher(llg.tokenizer, str(llguidance.LLMatcher.grammar_from_regex(pattern)),
                                    log_level=0)
    if not template.is_error():
        out["llguidance unmended"] = lambda: LlgMatcher(template.deep_copy(), llg.tokenizer, llg.stop_token_ids)
    return out


def fuzz(patterns: Sequence[str], bundle: TokenizerBundle, *, walks: int = 3, max_steps: int = 40,
         seed: int = 0) -> dict[str, Tally]:
    """Walk every pattern ``walks`` times under each grammar of :data:`GRAMMARS`.

    Returns grammar name -> :class:`json_fuzz.Tally` (``failed`` counts
    the closed outputs that are not a full match).
    """
    walker = Walker(bundle)
    rng = random.Random(seed)
    tallies = {name: Tally() for name in GRAMMARS}
    for pattern in patterns:
        try:
            meaning = re.compile(portable_regex(pattern))
            news = _matchers(walker, pattern)
        except (re.error, ServingError):
            continue

        def check(text: str, meaning: re.Pattern[str] = meaning) -> str | None:
            return None if meaning.fullmatch(text) else "not a full match"

        for grammar, new in news.items():
            if new is not None:
                walker.run(tallies[grammar], new, pattern, check, rng, walks, max_steps)
    return tallies


def main(argv: Sequence[str] | None = None) -> int:
    """Run the walks over a MaskBench folder's patterns and print the tallies."""
    parser = harness.bench_parser(__doc__)
    harness.add_data_dir(parser)
    harness.add_walks(parser, "pattern", 40)
    harness.add_seed(parser, 0, "walk")
    args = parser.parse_args(argv)
    patterns = sorted({p for f in sorted(args.data.glob("*.json"))
                       for p in patterns_of(json.loads(f.read_text(encoding="utf-8"))["schema"])})
    t0 = time.perf_counter()
    tallies = fuzz(patterns, load_tokenizer(harness.tiny_checkpoint()), walks=args.walks, max_steps=args.max_steps,
                   seed=args.seed)
    for grammar, t in tallies.items():
        print(f"{grammar:20} patterns {t.schemas:4}  walks {t.walks:5}  closed {t.closed:5}  "
              f"not a full match {t.failed:4}  limits {t.limits}  mask/accept mismatches {t.mismatches}")
        for pattern, text, why in t.examples:
            print(f"    {pattern[:60]!r}: {why}: {text!r}")
    print(f"{time.perf_counter() - t0:.0f} s, {len(patterns)} patterns")
    x, lg, rx, rl = (tallies[g] for g in GRAMMARS)
    print(f"closed regex outputs not a full match: xgrammar {x.failed}/{x.closed}, llguidance "
          f"{lg.failed}/{lg.closed}; unmended: xgrammar {rx.failed}/{rx.closed}, llguidance "
          f"{rl.failed}/{rl.closed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
