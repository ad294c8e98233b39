"""grammar_backend: constraints, compile cache, per-sequence matchers and batched bitmasks.

Pure Python over xgrammar and llguidance; nothing here knows Triton.  What
the Triton models share (parameters, metrics, teardown, the mask buffers and
the ``grammar`` model's service over :class:`GrammarEngine`) is in
:mod:`triton_support`.
"""
