"""Does every closed JSON output parse?  Random walks through each backend's mask, closed by the Closer.

A model may take any token the mask allows; a random walk takes them
uniformly, so it reaches what greedy decoding of a trained model rarely does:
control-character tokens inside strings, lone bytes, odd spellings.  Each walk
takes up to ``--max-steps`` tokens the mask allows (never the stop token),
then :class:`grammar_backend.closing.Closer` completes the output as
``on_budget: close`` does, and the bytes are decoded as the server's
detokenizer does (invalid UTF-8 becomes U+FFFD) and parsed with ``json.loads``.

Three grammars per schema: xgrammar as served (:func:`grammar_backend.compile.compile_spec`,
mended by :mod:`grammar_backend.json_strings`), llguidance as served, and
xgrammar's own compile without the mending (the reference that shows what the
walks catch).  Vocabulary: the tiny stand-in's byte-level BPE (448 tokens,
every byte one token; built once at ``harness.TINY_DIR``), so one step in
fourteen can be a control character.

Usage (from the repository root)::

    .venv/bin/python bench/json_fuzz.py ../shared/data/maskbench-dev               # 1,200 schemas, ~2 min
    .venv/bin/python bench/json_fuzz.py ../shared/data/maskbench-dev --count 200   # ~20 s

The last line reads ``closed outputs not JSON: xgrammar A/B, llguidance C/D;
xgrammar unmended E/F``.  Nothing here asserts; ``tests/unit/test_json_strings.py``
runs :func:`fuzz` on a few schemas.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import harness  # before the project's packages: it puts the repository root on sys.path
import xgrammar as xgr

from grammar_backend.bitmask import Matcher, allowed_tokens
from grammar_backend.closing import Closer
from grammar_backend.compile import compile_spec, json_format_kwargs
from grammar_backend.errors import ServingError
from grammar_backend.llg import LlgBackend
from grammar_backend.spec import ConstraintSpec, parse_constraint
from grammar_backend.tokenizer import TokenizerBundle, load_tokenizer

#: The grammars walked per schema, in report order.
GRAMMARS: Final = ("xgrammar", "llguidance", "xgrammar unmended")


@dataclass
class Tally:
    """One grammar's counts over a run."""

    schemas: int = 0
    walks: int = 0
    closed: int = 0
    failed: int = 0  # closed outputs the run's check refused
    limits: int = 0  # walks a backend's limit stopped
    mismatches: int = 0  # walks stopped where a matcher refused a token its own mask allowed (a backend defect)
    examples: list[tuple[str, str, str]] = field(default_factory=list)


class MaskMismatch(RuntimeError):
    """A matcher refused a token its own mask allowed."""


class Walker:
    """The three grammars of a schema over one vocabulary, and the random walk.

    Parameters
    ----------
    bundle : TokenizerBundle
        The vocabulary (:func:`grammar_backend.tokenizer.load_tokenizer`).
    """

    def __init__(self, bundle: TokenizerBundle) -> None:
        info = bundle.info
        self.vocab_size = info.vocab_size
        self.stops = frozenset(int(t) for t in info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.llg = LlgBackend(bundle.hf, info.vocab_size, sorted(self.stops))
        self.closer = Closer(info)
        self.mask = xgr.allocate_token_bitmask(1, info.vocab_size).numpy()

    def matchers(self, spec: ConstraintSpec) -> dict[str, Callable[[], Matcher] | None]:
        """A new-matcher factory per grammar; None where that grammar refuses the schema."""
        out: dict[str, Callable[[], Matcher] | None] = {}
        try:
            served = compile_spec(self.compiler, spec)
            out["xgrammar"] = lambda: xgr.GrammarMatcher(served)
        except ServingError:
            out["xgrammar"] = None
        try:
            compiled = self.llg.compile(spec)
            out["llguidance"] = lambda: self.llg.matcher(compiled)
        except ServingError:
            out["llguidance"] = None
        try:
            raw = self.compiler.compile_json_schema(spec.payload, **json_format_kwargs(spec.options))  # type: ignore[arg-type]
            out["xgrammar unmended"] = lambda: xgr.GrammarMatcher(raw)
        except RuntimeError:
            out["xgrammar unmended"] = None
        return out

    def run(self, tally: Tally, new: Callable[[], Matcher], name: str, check: Callable[[str], str | None],
            rng: random.Random, walks: int, max_steps: int) -> None:
        """``walks`` walks from new matchers, each closed output's text given to ``check`` (its reason
        to refuse it, or None), counted in ``tally`` (examples under ``name``)."""
        tally.schemas += 1
        for _ in range(walks):
            tally.walks += 1
            try:
                data = self.walk(new(), rng, max_steps)
            except ServingError:  # llguidance's parser or lexer limits (MatcherFailed)
                tally.limits += 1
                continue
            except MaskMismatch as err:
                tally.mismatches += 1
                if len(tally.examples) < 5:
                    tally.examples.append((name, "", str(err)))
                continue
            if data is None:
                continue
            tally.closed += 1
            text = data.decode("utf-8", "replace")
            why = check(text)
            if why is not None:
                tally.failed += 1
                if len(tally.examples) < 5:
                    tally.examples.append((name, text[:160], why))

    def walk(self, matcher: Matcher, rng: random.Random, max_steps: int) -> bytes | None:
        """One walk's output bytes, closed; None where the Closer finds no completion."""
        tokens: list[int] = []
        for _ in range(rng.randint(0, max_steps)):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(self.mask)
            allowed = [int(t) for t in allowed_tokens(self.mask[0], self.vocab_size) if int(t) not in self.stops]
            if not allowed:
                break
            token = rng.choice(allowed)
            if not matcher.accept_token(token):
                raise MaskMismatch(f"the mask allowed token {token} and the matcher refused it")
            tokens.append(token)
        if not matcher.is_terminated():
            tail = self.closer.complete(matcher)
            if tail is None:
                return None
            tokens.extend(tail)
        return self.closer.text(tokens)


def fuzz(schemas: Sequence[tuple[str, Any]], bundle: TokenizerBundle, *, walks: int = 3, max_steps: int = 80,
         seed: int = 0) -> dict[str, Tally]:
    """Walk every schema ``walks`` times under each grammar of :data:`GRAMMARS`.

    Parameters
    ----------
    schemas : sequence of (name, schema)
        Schemas the server's checks refuse are skipped.
    bundle : TokenizerBundle
    walks, max_steps, seed : int
        Walks per schema and grammar, most tokens before closing, the seed.

    Returns
    -------
    dict
        Grammar name -> :class:`Tally`.
    """
    walker = Walker(bundle)
    rng = random.Random(seed)
    tallies = {name: Tally() for name in GRAMMARS}
    for name, schema in schemas:
        try:
            spec = parse_constraint("json_schema", json.dumps(schema))
        except ServingError:
            continue
        for grammar, new in walker.matchers(spec).items():
            if new is not None:
                walker.run(tallies[grammar], new, name, _not_json, rng, walks, max_steps)
    return tallies


def _not_json(text: str) -> str | None:
    """Why ``text`` does not parse as JSON (None: it does)."""
    try:
        json.loads(text)
    except ValueError as err:
        return str(err)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fuzz over a MaskBench folder and print the tallies."""
    parser = harness.bench_parser(__doc__)
    harness.add_data_dir(parser)
    harness.add_count(parser, 1200)
    harness.add_walks(parser, "schema", 80)
    harness.add_seed(parser, 1, "sample and walk")
    harness.add_json(parser, "the tallies")
    args = parser.parse_args(argv)
    files = sorted(args.data.glob("*.json"))
    random.Random(args.seed).shuffle(files)
    schemas = [(f.name, json.loads(f.read_text(encoding="utf-8"))["schema"]) for f in files[:args.count]]
    bundle = load_tokenizer(harness.tiny_checkpoint())
    t0 = time.perf_counter()
    tallies = fuzz(schemas, bundle, walks=args.walks, max_steps=args.max_steps, seed=args.seed)
    wall = time.perf_counter() - t0
    for grammar, t in tallies.items():
        print(f"{grammar:18} schemas {t.schemas:5}  walks {t.walks:5}  closed {t.closed:5}  not JSON {t.failed:4}"
              f"  matcher limits {t.limits}  mask/accept mismatches {t.mismatches}")
        for name, text, err in t.examples:
            print(f"    {name}: {err}: {text!r}")
    if args.json is not None:
        harness.write_json(args.json, {g: {k: v for k, v in vars(t).items()} for g, t in tallies.items()})
    x, lg, raw = (tallies[g] for g in GRAMMARS)
    print(f"{wall:.0f} s")
    print(f"closed outputs not JSON: xgrammar {x.failed}/{x.closed}, llguidance {lg.failed}/{lg.closed}; "
          f"xgrammar unmended {raw.failed}/{raw.closed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
