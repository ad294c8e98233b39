"""Which backend serves a constraint: the two backends' names, ``backend: auto``'s order and its switch rule."""

from __future__ import annotations

from typing import Final

import contract
from grammar_backend.spec import ConstraintSpec, keyword_sites
from grammar_backend.values import unenforced_for

__all__ = ["LLGUIDANCE", "SWITCH_FILL_RATIO", "XGRAMMAR", "XGRAMMAR_DIFFERS", "auto_order", "may_switch_to_xgrammar"]

#: The backend names (the request contract's, ``contract.BACKENDS``).
XGRAMMAR, LLGUIDANCE = contract.BACKENDS


def auto_order(spec: ConstraintSpec) -> tuple[str, str]:
    """``backend: auto``'s order for a constraint both backends can take: the first, then the other.

    JSON kinds: llguidance first: it passes more (``bench/maskbench.py
    ../shared/data/maskbench-dev --backend auto``: 2,733 of 2,890, against
    2,723 with ``--backend llguidance``; the 400-schema comparison of both
    orders is in docs/benchmarks.md).  xgrammar's failures are compiles that
    run out of memory or time (the worker ships each grammar as JSON, many
    times its size) and keywords it leaves open (``format: date`` lets
    ``2023-02-30`` through) where llguidance enforces them; llguidance
    compiles lazily.  Other kinds: xgrammar first (the two were not compared
    on them; xgrammar fills a batch of rows in one call).  This is the order
    of a constraint's first start; a JSON constraint may move to xgrammar
    after its first output (:func:`may_switch_to_xgrammar`,
    :mod:`grammar_service.auto_switch`).
    """
    return (LLGUIDANCE, XGRAMMAR) if spec.kind.is_json else (XGRAMMAR, LLGUIDANCE)


#: ``backend: auto`` moves a JSON constraint from llguidance to xgrammar where xgrammar's mask fills along the
#: constraint's first completed output cost at most this fraction of llguidance's
#: (:mod:`grammar_service.auto_switch`): a fifth saved at least, since one replay is one sample of the
#: constraint's outputs and the switch holds a second compiled grammar.
SWITCH_FILL_RATIO: Final = 0.8

#: Keywords whose schemas stay on llguidance whatever xgrammar's fill costs: on a 600-schema maskbench-dev
#: sample (seed 0), every schema both compiled where xgrammar failed and llguidance passed used one of them
#: (7 of 7: regex translation of ``pattern`` and ``patternProperties``, 5; ``oneOf`` and ``allOf``, 2), and
#: switching without this rule lost 2 of them (docs/benchmarks.md, "backend auto's switch").
XGRAMMAR_DIFFERS: Final = frozenset({"pattern", "patternProperties", "oneOf", "allOf"})


def may_switch_to_xgrammar(spec: ConstraintSpec) -> bool:
    """Whether xgrammar may serve the JSON constraint ``spec`` in llguidance's place, its fill cost aside.

    Its fidelity report must leave nothing unenforced that llguidance's enforces (``format: date``'s
    calendar, ``multipleOf``: the value checks would catch what xgrammar lets through, at the price of a
    retry), and the schema must use none of :data:`XGRAMMAR_DIFFERS`.
    """
    if not spec.kind.is_json or spec.schema is None:
        return False
    if any(key in XGRAMMAR_DIFFERS for _, key, _ in keyword_sites(spec.schema)):
        return False
    xgrammar = {(u.pointer, u.keyword) for u in unenforced_for(spec, XGRAMMAR)}
    return xgrammar <= {(u.pointer, u.keyword) for u in unenforced_for(spec, LLGUIDANCE)}
