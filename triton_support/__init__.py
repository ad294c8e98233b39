"""triton_support: what the four Triton models share and the engines do not.

- :mod:`triton_support.params`: a model's ``parameters`` block parsed into its
  frozen config (unknown or unfilled keys refused);
- :mod:`triton_support.metrics`: the metric catalog, the snapshots the engines
  fill and the publisher that turns them into ``pb_utils`` metrics;
- :mod:`triton_support.teardown`: what ``finalize`` runs;
- :mod:`triton_support.maskbuf`: the shared-memory bitmask buffers between the
  ``llm`` and ``grammar`` models;
- :mod:`triton_support.service`: the ``grammar`` model's service over
  :class:`grammar_backend.engine.GrammarEngine` (requests, the channel, metrics).

It sits above :mod:`grammar_backend` (which never knows Triton) and below
:mod:`llm_runtime`, :mod:`pipeline` and the ``model.py`` adapters; ``pb_utils``
is passed in by the adapters, never imported here.
"""
