"""Schema fidelity of xgrammar decoding, and full post-validation of outputs.

Three jobs, one module each: :mod:`.table` (what xgrammar 0.2.9 enforces of
each keyword, each row pinned by a test), :mod:`.walker` (which keywords of one schema
decoding leaves unenforced, following the table), :mod:`.validator` (parse a
finished output and validate it against the full schema); :mod:`.report`
holds the records they return.  ``$ref`` resolution goes through
``referencing`` everywhere, and the meta-schema check is
:func:`grammar_backend.spec.check_schema`.

Two questions are answered here, both for JSON Schema (Draft 2020-12)
constraints:

1. **Which keywords of a schema does decoding NOT enforce?**
   :func:`unenforced_keywords` walks a schema and reports every keyword whose
   violation can survive constrained decoding with xgrammar 0.2.9, compiled as
   the grammar engine does (``any_whitespace=False``, ``separators=(",", ":")``,
   ``any_order=False``, ``indent=None``, ``max_whitespace_cnt=None``).  The rules
   are not guesses: every rule below was established by compiling a schema and
   pushing known-valid and known-invalid compact JSON instances through an
   ``xgrammar.GrammarMatcher`` byte by byte, and each rule is pinned by a case in
   ``tests/unit/test_fidelity_table.py`` (the case names are cited in the comments).
2. **Is a finished output valid?**  :class:`PostValidator` parses the output
   text (with the line and column of a syntax error) and validates it with
   ``jsonschema.Draft202012Validator`` and its format checker, returning every
   violation with a JSON pointer into the instance.  A validator is built once
   per constraint and reused for every output of that constraint.

What xgrammar 0.2.9 does (observed; see :data:`KEYWORD_TABLE` and
:data:`REFUSED_CONSTRUCTS`):

* A subschema is compiled from ONE "winning" keyword when it has any of, in
  this precedence, ``$ref`` > ``const`` > ``enum`` > ``anyOf`` > ``oneOf`` >
  ``allOf``; every other assertion next to the winner is ignored
  (cases ``ref_sibling_minimum``, ``const_sibling_maxlength``, ``enum_sibling_type``,
  ``anyof_sibling_minimum``, ``oneof_sibling_minimum``, ``allof1_sibling_minimum``,
  ``precedence_*``).  For ``const``/``enum`` this matters only when a listed value
  violates a sibling, which is checked exactly with ``jsonschema``.
* ``allOf`` with other than exactly one subschema compiles to *any JSON value*
  (``allof2_int_min``, ``allof2_objects``); ``oneOf`` is compiled as ``anyOf``, so
  exclusivity holds only where the branches are disjoint (``oneof_*``; reported
  unless a sound disjointness proof succeeds: distinct types, distinct
  ``const``/``enum`` values, or a required discriminator property).
* A subschema without ``type`` is compiled as any JSON value unless it has
  ``properties``/``additionalProperties``/``unevaluatedProperties`` (then an
  object) or ``items``/``prefixItems``/``unevaluatedItems`` (then an array), so
  ``{"minimum": 5}`` accepts ``3`` (``untyped_*``).
* Never enforced: ``uniqueItems``, ``contains``/``minContains``/``maxContains``,
  ``dependentRequired``, ``dependentSchemas``, ``if``/``then``/``else``, ``not``,
  ``$dynamicRef``.
* Enforced only in part:

  - ``multipleOf``: integers only, ``0 < m <= 1024``, with no bound or with both
    bounds spanning at most 10,000 integers;
  - strings: a format xgrammar supports wins, and ``pattern`` and
    ``minLength``/``maxLength`` next to it are ignored; ``pattern`` wins over the
    lengths; lookahead assertions in a pattern are ignored; ``date``/``date-time``
    do not check the calendar, ``ipv4`` accepts leading zeros, ``hostname`` has
    no length limits; ``idn-email``, ``idn-hostname``, ``iri``, ``iri-reference``
    and ``regex`` are not enforced;
  - objects: ``required`` names missing from ``properties`` are ignored;
    ``propertyNames`` exempts declared names, is ignored next to
    ``patternProperties``, lets declared names reappear unchecked on an open
    object and keeps an object with no declared property open whatever
    ``additionalProperties``/``unevaluatedProperties``/strict mode say;
    ``patternProperties`` next to declared properties on an open object accepts
    any further key unchecked, and a declared name that matches a pattern is
    checked against one schema only; ``unevaluatedProperties: false`` is
    ignored on an otherwise open object;
  - ``$ref``: only ``#`` and ``#/...`` JSON-pointer references are followed;
    others compile to any JSON value.

* Narrowing (valid instances excluded, never invalid ones admitted, so not
  reported; pinned by ``test_documented_narrowings``): ``pattern`` is matched
  against the whole string (``"^a"`` rejects ``"abc"``), strings under a length
  bound cannot contain escapes, keys must follow the schema order,
  ``patternProperties`` alone closes the object, ``strict_mode=True`` closes
  objects with ``properties``/``required`` and arrays with ``prefixItems`` that
  leave them open, untyped ``properties`` schemas admit only objects, bounded
  numbers admit no exponent form (``{"type":"number","minimum":1.5}`` rejects
  ``2e0``), ``{"const": 1.0}`` admits only ``1``, number bounds beyond what a
  double holds.
* Repeated keys are not prevented among additional or pattern properties (not a
  schema keyword, so not reported here); :class:`PostValidator` reports them as
  ``duplicate-key`` violations because JSON parsers disagree on their meaning.

Refusals (xgrammar raises ``RuntimeError`` at compile time) are a different case:
they never produce an unfaithful grammar, so they are listed in
:data:`REFUSED_CONSTRUCTS` rather than reported per schema.  The engine adds
one (:mod:`grammar_backend.json_strings`, ``ValueError``): a ``pattern`` that
names a character JSON must escape, which xgrammar would write into the
string raw.  The same module narrows the class of length-bounded strings to
what JSON allows unescaped: xgrammar's admits raw control characters.

Costs: the Draft 2020-12 meta-schema check dominates building a
:class:`PostValidator` or calling :func:`unenforced_keywords` (over a hundred
times the keyword walk; no bench times these, the figures are in
docs/benchmarks.md).  Build one :class:`PostValidator` per constraint and take
:meth:`PostValidator.unenforced` from it to pay the meta-schema check once.
"""

from grammar_backend.fidelity.report import (
    Enforcement,
    KeywordFidelity,
    RefusedConstruct,
    UnenforcedKeyword,
    ValidationReport,
    Violation,
    result_json,
)
from grammar_backend.fidelity.table import KEYWORD_TABLE, REFUSED_CONSTRUCTS, XGRAMMAR_VERSION_MEASURED, checked_formats
from grammar_backend.fidelity.validator import VALIDATOR_CACHE_SIZE, PostValidator, validate_output, validator_for
from grammar_backend.fidelity.walker import unenforced_keywords

__all__ = [
    "KEYWORD_TABLE",
    "REFUSED_CONSTRUCTS",
    "VALIDATOR_CACHE_SIZE",
    "XGRAMMAR_VERSION_MEASURED",
    "Enforcement",
    "KeywordFidelity",
    "PostValidator",
    "RefusedConstruct",
    "UnenforcedKeyword",
    "ValidationReport",
    "Violation",
    "checked_formats",
    "result_json",
    "unenforced_keywords",
    "validate_output",
    "validator_for",
]
