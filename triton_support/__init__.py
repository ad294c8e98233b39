"""triton_support: what the four Triton models share and the engines do not.

- :mod:`triton_support.params`: a model's ``parameters`` block parsed into its
  frozen config (unknown or unfilled keys refused);
- :mod:`triton_support.metrics`: the metric catalog and the publisher that
  turns the engines' snapshots (:mod:`telemetry`) into ``pb_utils`` metrics;
- :mod:`triton_support.teardown`: what ``finalize`` runs;
- :mod:`triton_support.service`: the ``grammar`` model's service over
  :class:`grammar_service.engine.GrammarEngine` (requests, the channel, metrics).

It sits above :mod:`grammar_service` and :mod:`telemetry` (which never know
Triton) and beside :mod:`llm_runtime`, which imports nothing from here;
:mod:`pipeline` and the ``model.py`` adapters sit above.  ``pb_utils`` is
passed in by the adapters, never imported here.
"""
