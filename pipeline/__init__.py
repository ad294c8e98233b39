"""The request pipeline around decoding: preprocessing (the authority on a request's fields,
chat template, tokenization) and postprocessing (finish reason, JSON parse, full-schema
validation, the RESULT document).

Both are pure Python over :mod:`contract` and :mod:`grammar_backend`; the
``preprocessing`` and ``postprocessing`` Triton models (and the ``llm``
model, for the request it receives and the final state it sends) are thin
adapters over them.
"""
