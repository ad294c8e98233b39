"""How a grammar step travels between the decode loop and the grammar service.

- :mod:`grammar_service.transport.channel`: the grammar channel, a Unix socket
  that carries the step's requests and its answer
  (:mod:`grammar_backend.protocol`);
- :mod:`grammar_service.transport.maskbuf`: the shared-memory buffers the
  service writes a caller's bitmask rows into.

The other two ways are the in-process provider
(:mod:`llm_runtime.local_mask`) and the ``grammar`` model's BLS tensors
(:func:`grammar_backend.protocol.answer_tensors`).
"""
