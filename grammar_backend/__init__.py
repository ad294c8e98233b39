"""grammar_backend: constraints, compile cache, per-sequence matchers and batched bitmasks.

Pure Python over xgrammar; never imports ``triton_python_backend_utils``.
The ``grammar`` Triton model is a thin adapter over :class:`GrammarEngine`.
"""

from grammar_backend.bitmask import BitmaskBuffer, bitmask_width
from grammar_backend.cache import CacheConfig, CacheStats, CompileCache, GrammarStore
from grammar_backend.compile import XGRAMMAR_VERSION, compile_spec
from grammar_backend.engine import GrammarEngine, GrammarEngineConfig, StepResult
from grammar_backend.sequences import GrammarSequence, SequenceTable, TableConfig
from grammar_backend.spec import (
    ConstraintKind,
    ConstraintOptions,
    ConstraintSpec,
    SpecLimits,
    parse_constraint,
)

__all__ = [
    "XGRAMMAR_VERSION",
    "BitmaskBuffer",
    "CacheConfig",
    "CacheStats",
    "CompileCache",
    "ConstraintKind",
    "ConstraintOptions",
    "ConstraintSpec",
    "GrammarEngine",
    "GrammarEngineConfig",
    "GrammarSequence",
    "GrammarStore",
    "SequenceTable",
    "SpecLimits",
    "StepResult",
    "TableConfig",
    "bitmask_width",
    "compile_spec",
    "parse_constraint",
]
