"""The llguidance backend: compile a :class:`ConstraintSpec` with llguidance and match it
through the matcher interface the engine, the closer and jump-forward use.

xgrammar compiles eagerly (a schema can take seconds and gigabytes, see
:mod:`grammar_service.workers`); llguidance builds its lexer lazily, so a
grammar is ready in milliseconds and each mask costs more
(``bench/grammar_step_bench.py --backend llguidance``: raw fill p50 4.24 ms at
64 rows of Qwen3's vocabulary, against 1.16 ms for xgrammar's in the same
session).  The two also fail on different schemas, which is why
``backend: auto`` (:func:`grammar_backend.backends.auto_order`) serves JSON with
llguidance first and xgrammar where llguidance refuses it, and the other kinds
the other way round.

Both write the same packed int32 bitmask (bit ``j`` of word ``j // 32`` is
token ``j``, least significant bit first), so llguidance rows share the
engine's bitmask buffer; its tokenizer is built with the model's padded
vocabulary size and stop tokens, so the rows have the same width.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import llguidance.numpy
import numpy as np

import contract
from grammar_backend.errors import CompileError, ConfigError, MatcherFailed
from grammar_backend.fidelity.report import UnenforcedKeyword
from grammar_backend.lru import Lru
from grammar_backend.regex_dialect import portable_regex
from grammar_backend.spec import ConstraintKind, ConstraintOptions, ConstraintSpec, keyword_sites

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

LLGUIDANCE_VERSION: Final = importlib.metadata.version("llguidance")

#: What an llguidance grammar is charged in the compile cache: its text plus a
#: fixed share for the lexer it builds lazily (llguidance does not report its
#: memory; its documentation puts a lexer state at 1-2 kB, and the default
#: state limit is 250,000, so this is an estimate, not a measurement).
LEXER_ESTIMATE_BYTES: Final = 1 << 20


def refusal(spec: ConstraintSpec) -> CompileError | None:
    """Why llguidance cannot serve ``spec`` as asked (None: it can).

    Structural tags (xgrammar's format, not translated) and the options it
    cannot honour: ``indent`` (no pretty printer), ``any_order`` (it fixes
    properties to the schema's order) and ``strict`` (no mode that closes
    open objects).
    """
    if spec.kind is ConstraintKind.STRUCTURAL_TAG:
        return CompileError("grammar_type", f"{spec.kind.value} is not supported by the llguidance backend")
    options = spec.options
    for name, value in (("indent", options.indent), ("any_order", options.any_order), ("strict", options.strict)):
        if value not in (None, False):
            return CompileError(f"grammar_options.{name}", "is not supported by the llguidance backend")
    return None


def json_compile_options(options: ConstraintOptions) -> JsonCompileOptions:
    """llguidance's JSON options (``x-guidance``) for ``options`` (which :func:`refusal` accepted)."""
    # As the server does with xgrammar: what the grammar cannot express is
    # approximated or left out (oneOf as anyOf; uniqueItems, not, unknown
    # formats ignored) and checked by post-validation, instead of refusing the
    # schema: strict, llguidance refused 12 of 400 maskbench-dev schemas for
    # these (docs/benchmarks.md; no bench option runs it strict).
    relaxed: JsonCompileOptions = {"coerce_one_of": True, "lenient": True}
    if options.whitespace == "compact":
        return {**relaxed, "whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    if options.whitespace == "any":
        return {**relaxed, "whitespace_flexible": True}
    # A bounded run between tokens, as xgrammar's max_whitespace_cnt.
    return {**relaxed, "whitespace_flexible": True,
            "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{options.whitespace}}}"}


def lark_of(spec: ConstraintSpec) -> str:
    """The grammar text llguidance's ``LLMatcher`` takes for ``spec``.

    Raises
    ------
    CompileError
        :func:`refusal`'s reason.
    """
    refused = refusal(spec)
    if refused is not None:
        raise refused
    kind = spec.kind
    if kind.is_json:
        schema = spec.payload if kind is ConstraintKind.JSON_SCHEMA else contract.JSON_OBJECT_SCHEMA
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_compile_options(spec.options)))
        except ValueError as err:
            raise CompileError("grammar", f"llguidance cannot compile this {kind.value}: {err}") from err
    if kind is ConstraintKind.REGEX:
        return str(llguidance.LLMatcher.grammar_from_regex(portable_regex(spec.payload)))
    if kind is ConstraintKind.LARK:
        return str(llguidance.LLMatcher.grammar_from_lark(spec.payload))
    if kind is ConstraintKind.EBNF:
        return str(llguidance.LLMatcher.grammar_from_lark(_gbnf_to_lark(spec.payload)))
    if kind is ConstraintKind.CHOICE:
        # Lark string literals read JSON escapes, so json.dumps spells any choice.
        return str(llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.document)))
    raise CompileError("grammar_type", f"{kind.value} is not supported by the llguidance backend")  # not reached


def _gbnf_to_lark(ebnf: str) -> str:
    """llguidance's GBNF-to-Lark translation, its refusals as :class:`CompileError`.

    Raises
    ------
    CompileError
        The grammar has no ``root`` rule, names an undefined rule, or nests
        deeper than Python's recursion limit (the translator is a recursive
        descent parser in Python).
    """
    try:
        return str(llguidance.gbnf_to_lark.gbnf_to_lark(ebnf))
    except RecursionError as err:
        raise CompileError("grammar", "llguidance cannot compile this ebnf: it nests too deeply") from err
    except Exception as err:  # llguidance 1.9 raises a bare Exception for every grammar error
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CompileError("grammar", f"llguidance cannot compile this ebnf: {reason}") from err


@dataclass(eq=False)
class LlgCompiled:
    """A validated llguidance grammar: sequences start from copies of its templates.

    Copies of one template share its lexer, and llguidance locks it for each
    use (``Parser.shared``, an ``Arc<Mutex<..>>`` that ``deep_copy`` clones):
    fill threads over copies of one template take turns at it.  So a grammar
    whose sequences run side by side gets further templates, built apart, up
    to one per fill thread: a start that finds every template copied by a
    live sequence has one more built off its path, and each start copies the
    template with the fewest live copies (:meth:`take`; the threads, the lock
    and the builds are :class:`grammar_service.llg_spread.TemplateSpread`'s).
    A grammar one sequence at a time keeps its one template (its lexer warm,
    no build for nothing).  :class:`~grammar_backend.bitmask.BitmaskBuffer`
    hands the batched fill its rows grouped by template.  Two threads over
    one, the engine's step along 64 rows (``bench/grammar_step_bench.py
    --fill-states --threads 2``): 0.97 with copies of one template, 0.56-0.62
    with two (this host's own ceiling 0.53).

    :meth:`take`, :meth:`release` and :meth:`built` are called one at a time (the caller's lock).

    Attributes
    ----------
    grammar : str
    templates : list of llguidance.LLMatcher
        Matchers in their initial state, never advanced (``deep_copy`` is cheaper than a new one); only
        appended to.
    memory_size_bytes : int
        What the compile cache charges for it (see :data:`LEXER_ESTIMATE_BYTES`): one template's.  Further
        templates are built only for a grammar with sequences side by side and are not charged.
    most : int
        The most templates it may have (the fill threads; 1 for a heavy constraint).
    live : list of int
        The live copies of each template.
    building : bool
        Whether a further template is being built.
    """

    grammar: str
    templates: list[Any]
    memory_size_bytes: int
    most: int = 1
    live: list[int] = field(default_factory=lambda: [0])
    building: bool = False

    def take(self) -> tuple[int, bool]:
        """The template a new sequence copies (the fewest live copies), and whether to build one more:
        every template has a live copy, none is being built, and there are fewer than :attr:`most`."""
        live = self.live
        family = live.index(min(live))
        grow = live[family] > 0 and not self.building and len(self.templates) < self.most
        live[family] += 1
        self.building = self.building or grow
        return family, grow

    def release(self, family: int) -> None:
        """A copy of template ``family`` is gone (its sequence ended)."""
        self.live[family] -= 1

    def built(self, template: Any | None) -> None:
        """A further template (None: its build failed) is ready to be copied."""
        if template is not None:
            self.templates.append(template)
            self.live.append(0)
        self.building = False


class LlgBackend:
    """llguidance's tokenizer (built once per engine), its compile, and its sequences' matchers.

    Parameters
    ----------
    hf_tokenizer : transformers.PreTrainedTokenizerFast
    vocab_size : int
        The model's logits width (the bitmask width in bits).
    stop_token_ids : sequence of int
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                       eos_token=[int(t) for t in stop_token_ids])
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)

    def compile(self, spec: ConstraintSpec, fill_threads: int = 1) -> LlgCompiled:
        """Build and validate ``spec``'s grammar, for sequences spread over ``fill_threads`` fill threads
        (up to that many templates: :class:`LlgCompiled`).

        Raises
        ------
        CompileError
            llguidance refuses the constraint (its reason).
        ConfigError
            ``fill_threads`` is not positive.
        """
        if fill_threads <= 0:
            raise ConfigError(f"llguidance compile: fill_threads must be positive, got {fill_threads}")
        grammar = lark_of(spec)
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        # Some limits show only when the parser advances (a choice of more than
        # 2,000 alternatives exceeds its items per row at the first token): a
        # copy takes the first allowed token, so they refuse the compile
        # instead of failing the sequence at its first step.
        probe = template.deep_copy()
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(template.compute_bitmask(), np.uint8), bitorder="little"))
        if allowed.size:
            probe.consume_token(int(allowed[0]))
        for matcher in (template, probe):
            if matcher.is_error():
                reason = matcher.get_error().strip().splitlines()[0]
                raise CompileError("grammar", f"llguidance cannot compile this {spec.kind.value}: {reason}")
        return LlgCompiled(grammar, [template], len(grammar) + LEXER_ESTIMATE_BYTES, fill_threads)

    def template(self, compiled: LlgCompiled) -> Any:
        """A further template of ``compiled``, built apart (about one compile)."""
        return llguidance.LLMatcher(self.tokenizer, compiled.grammar, log_level=0)

    def matcher(self, compiled: LlgCompiled, family: int = 0) -> LlgMatcher:
        """A new sequence's matcher: a copy of template ``family`` (see :class:`LlgCompiled`)."""
        return LlgMatcher(compiled.templates[family].deep_copy(), self.tokenizer, self.stop_token_ids, family)


class LlgMatcher:
    """xgrammar's ``GrammarMatcher`` interface over an ``llguidance.LLMatcher``.

    The engine, :class:`~grammar_backend.closing.Closer` and
    :class:`~grammar_backend.jump.JumpForward` call these methods on either
    kind of matcher.  Differences bridged here:

    * ``LLMatcher.consume_token`` puts the matcher in a permanent error state
      on a token the grammar rejects, so each token is checked first
      (``validate_tokens``); a rejected token leaves the matcher unchanged,
      as in xgrammar.
    * A stop token ends the sequence: llguidance allows it wherever the
      grammar may end (``is_accepting``) and :meth:`is_terminated` is true
      only once it is accepted, as in xgrammar (llguidance's ``is_stopped``
      is already true when only the stop token is left).
    * :meth:`accept_string` spells the text with llguidance's tokenizer, and
      :meth:`rollback` counts it as one step, as xgrammar does.
    """

    __slots__ = ("__weakref__", "_eos", "_m", "_steps", "_stops", "_terminated", "_tokenizer", "family")

    def __init__(self, matcher: Any, tokenizer: Any, stop_token_ids: frozenset[int], family: int = 0) -> None:
        self._m = matcher
        #: Which of its grammar's templates it copies (:class:`LlgCompiled`): the batched fill groups rows by it.
        self.family = family
        self._tokenizer = tokenizer
        self._stops = stop_token_ids
        # The stop token llguidance itself validates (where it is one of ours): completes() asks for it.
        eos = int(tokenizer.eos_token)
        self._eos: int | None = eos if eos in stop_token_ids else None
        self._steps: list[int] = []  # tokens consumed by each accepted step, for rollback
        self._terminated = False

    def accept_token(self, token: int) -> bool:
        """Accept one token; False (matcher unchanged) when the grammar rejects it.

        Raises
        ------
        MatcherFailed
            llguidance went past one of its limits (its error state is permanent).
        """
        if self._terminated:
            return False
        size = 1
        if token in self._stops:
            # Where only the stop was left, llguidance has stopped already: the stop it consumes then is
            # not in its history, and a rollback of one token would undo the token before it.
            size = 0 if self._m.is_stopped() else 1
            ok = self._m.is_accepting() and self._m.consume_token(token)
        else:
            ok = self._m.validate_tokens([token]) == 1 and self._m.consume_token(token)
        if not ok:
            self._check()
            return False
        self._terminated = token in self._stops
        self._steps.append(size)
        return True

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` next (its mask bit); the matcher does not move.

        One ``validate_tokens`` call: an accept and rollback would advance the
        parser, where a limit it meets puts the matcher in its error state for good.
        """
        if self._terminated:
            return False
        if token in self._stops:
            return bool(self._m.is_accepting())
        return int(self._m.validate_tokens([token])) == 1

    def completes(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` are accepted and leave the grammar complete; the matcher does not move.

        One ``validate_tokens`` call over the tokens and the stop token,
        where :meth:`~grammar_backend.closing.Closer.accepts` would accept
        and roll back token by token: 7 us against 82 us for a 51-token
        completion (timed alone; docs/benchmarks.md, the serving path's
        second round).  Budget closing asks this of every tail it tries.
        """
        if self._terminated:
            return not tokens
        if not tokens:
            return bool(self._m.is_accepting())
        n = len(tokens)
        if self._eos is not None:
            return int(self._m.validate_tokens([*tokens, self._eos])) == n + 1
        if int(self._m.validate_tokens(list(tokens))) != n or not self._m.consume_tokens(list(tokens)):
            self._check()
            return False
        done = bool(self._m.is_accepting())
        if not self._m.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self._m.get_error()}")
        return done

    def accept_string(self, text: str) -> bool:
        """Accept ``text`` as one step; False (matcher unchanged) when the grammar rejects it."""
        tokens = self._tokenizer.tokenize_str(text)
        if self._terminated or not tokens:
            return False
        if self._m.validate_tokens(tokens) != len(tokens) or not self._m.consume_tokens(tokens):
            self._check()
            return False
        self._steps.append(len(tokens))
        return True

    def _check(self) -> None:
        if self._m.is_error():
            reason = self._m.get_error().strip().splitlines()[0]
            raise MatcherFailed(f"llguidance stopped: {reason}")

    def rollback(self, steps: int) -> None:
        """Undo the last ``steps`` accepted tokens or strings."""
        if not 0 <= steps <= len(self._steps):
            raise ValueError(f"cannot roll back {steps} steps (at most {len(self._steps)})")
        if steps:
            tokens = sum(self._steps[-steps:])
            del self._steps[-steps:]
            self._terminated = False  # a stop token can only be the last step
            if tokens and not self._m.rollback(tokens):
                raise RuntimeError(f"llguidance could not roll back {tokens} tokens: {self._m.get_error()}")

    @property
    def inner(self) -> Any:
        """The ``llguidance.LLMatcher`` (for the batched fill of :class:`~grammar_backend.bitmask.BitmaskBuffer`)."""
        return self._m

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted."""
        return self._terminated

    def is_completed(self) -> bool:
        """Whether the grammar may end here (a stop token is allowed)."""
        return self._terminated or bool(self._m.is_accepting())

    def find_jump_forward_string(self) -> str:
        """The text the grammar forces next (whole UTF-8 characters only)."""
        data = bytes(self._m.compute_ff_bytes())
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                return data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int = 0) -> None:
        """Write the mask of the next token into row ``index`` of ``bitmask``."""
        llguidance.numpy.fill_next_token_bitmask(self._m, bitmask, index)


#: Keywords whose values are data or names, never schemas (not searched for keywords).
_UNIMPLEMENTED: Final = re.compile(r"^Unimplemented keys: (\[.*\])$")
_UNKNOWN_FORMAT: Final = re.compile(r"^Unknown format: (.*)$")


def unenforced_keywords(spec: ConstraintSpec) -> tuple[UnenforcedKeyword, ...]:
    """What llguidance leaves unenforced in ``spec``'s schema: the fidelity report of an llguidance-served output.

    Read from llguidance's own warnings on the grammar it builds
    (``validate_grammar_with_warnings``, lenient and ``coerce_one_of`` as
    served): unimplemented keywords, unknown formats and ``oneOf`` taken as
    ``anyOf``, each reported at every place the schema uses it (llguidance's
    warnings carry no location).  Empty for non-JSON kinds.  Cached per constraint.
    """
    if not spec.kind.is_json or refusal(spec) is not None:
        return ()
    cached = _UNENFORCED.get(spec)
    if cached is not None:
        return cached
    failed, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(lark_of(spec))
    if failed:
        return ()
    keywords: dict[str, str] = {}
    formats: set[str] = set()
    for warning in warnings:
        if match := _UNIMPLEMENTED.match(warning):
            keywords.update((k, "not implemented by llguidance (ignored while decoding)") for k in json.loads(match[1]))
        elif match := _UNKNOWN_FORMAT.match(warning):
            formats.add(match[1])
        elif warning.startswith("oneOf not fully supported"):
            keywords["oneOf"] = "decoded as anyOf by llguidance (exactly one is not enforced)"
    found: list[UnenforcedKeyword] = []
    for at, key, value in keyword_sites(spec.schema):
        if key in keywords:
            found.append(UnenforcedKeyword(at, key, keywords[key]))
        if key == "format" and isinstance(value, str) and value in formats:
            found.append(UnenforcedKeyword(at, key, f"format {value!r} is unknown to llguidance (ignored)"))
    return _UNENFORCED.put(spec, tuple(sorted(found, key=lambda u: u.pointer)))


_UNENFORCED: Lru[ConstraintSpec, tuple[UnenforcedKeyword, ...]] = Lru(256)
