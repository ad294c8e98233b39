"""Which backend serves a constraint: the two backends' names and ``backend: auto``'s order."""

from __future__ import annotations

import contract
from grammar_backend.spec import ConstraintSpec

__all__ = ["LLGUIDANCE", "XGRAMMAR", "auto_order"]

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
    on them; xgrammar fills a batch of rows in one call).
    """
    return (LLGUIDANCE, XGRAMMAR) if spec.kind.is_json else (XGRAMMAR, LLGUIDANCE)
