"""grammar_backend: constraints, compile cache, per-sequence matchers and batched bitmasks.

Pure Python over xgrammar; never imports ``triton_python_backend_utils``.
The ``grammar`` Triton model is a thin adapter over :class:`GrammarEngine`.
"""
