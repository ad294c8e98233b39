"""Translate a :class:`ConstraintSpec` into one xgrammar compiler call."""

from __future__ import annotations

import importlib.metadata
import re
from typing import Final

import xgrammar as xgr

import contract
from grammar_backend import json_strings
from grammar_backend.errors import CompileError
from grammar_backend.regex_dialect import misplaced_anchor, portable_regex
from grammar_backend.spec import ConstraintKind, ConstraintOptions, ConstraintSpec, choice_ebnf

XGRAMMAR_VERSION: Final = importlib.metadata.version("xgrammar")

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /project/cpp/file.cc:123: ";
# clients need the reason, not our build paths.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def json_format_kwargs(options: ConstraintOptions) -> dict[str, object]:
    """Keyword arguments of ``compile_json_schema`` for ``options``.

    With ``any_whitespace=False`` xgrammar's default separators are ``", "``
    and ``": "``; compact JSON needs ``(",", ":")`` explicitly.
    """
    kwargs: dict[str, object] = {
        "strict_mode": options.strict,
        "any_order": options.any_order,
        "indent": options.indent,
    }
    if options.whitespace == "compact":
        kwargs["any_whitespace"] = False
        if options.indent is None:
            kwargs["separators"] = (",", ":")
    else:
        kwargs["any_whitespace"] = True
        if isinstance(options.whitespace, int):
            kwargs["max_whitespace_cnt"] = options.whitespace
    return kwargs


def compile_json(compiler: xgr.GrammarCompiler, schema: str, options: ConstraintOptions) -> xgr.CompiledGrammar:
    """Compile the JSON Schema text ``schema`` as every JSON kind is compiled (:func:`json_format_kwargs`).

    The compile is :func:`grammar_backend.json_strings.compile_json_schema`:
    xgrammar's, with its strings kept valid JSON.  xgrammar's own errors and
    that module's refusal propagate (:func:`compile_spec` turns them into a
    :class:`CompileError`); the fidelity tests compile through here too, so
    what they measure is what is served.
    """
    return json_strings.compile_json_schema(compiler, schema, **json_format_kwargs(options))


def compile_spec(compiler: xgr.GrammarCompiler, spec: ConstraintSpec) -> xgr.CompiledGrammar:
    """Compile ``spec`` with ``compiler``.

    Raises
    ------
    CompileError
        When xgrammar rejects the constraint (its reason, without C++ paths).
    """
    try:
        kind = spec.kind
        if kind is ConstraintKind.JSON_SCHEMA:
            return compile_json(compiler, spec.payload, spec.options)
        if kind is ConstraintKind.JSON_OBJECT:
            # Any object, through the schema compiler: unlike the builtin JSON
            # grammar it honours the whitespace policy.
            return compile_json(compiler, contract.JSON_OBJECT_SCHEMA, spec.options)
        if kind is ConstraintKind.REGEX:
            anchor = misplaced_anchor(spec.payload)
            if anchor is not None:
                raise CompileError("grammar", f"xgrammar would drop the {spec.payload[anchor]!r} at offset {anchor} "
                                              f"of this regex and admit text the pattern does not; choose backend "
                                              f"llguidance for it")
            return compiler.compile_regex(portable_regex(spec.payload))
        if kind is ConstraintKind.EBNF:
            return compiler.compile_grammar(spec.payload)
        if kind is ConstraintKind.LARK:
            return compiler.compile_lark(spec.payload)
        if kind is ConstraintKind.CHOICE:
            return compiler.compile_grammar(choice_ebnf(spec.document))
        return json_strings.compile_structural_tag(compiler, spec.document)
    except (RuntimeError, ValueError, TypeError, xgr.InvalidStructuralTagError) as err:
        reason = _CPP_PREFIX.sub("", str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
        raise CompileError("grammar", f"xgrammar cannot compile this {spec.kind.value}: {reason}") from err
