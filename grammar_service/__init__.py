"""grammar_service: the grammar core (:mod:`grammar_backend`) served to many sequences at once.

- :mod:`grammar_service.engine`: :class:`~grammar_service.engine.GrammarEngine`,
  one batched step over the active sequences, and its answer;
- :mod:`grammar_service.table`: the table of active sequences;
- :mod:`grammar_service.cache`: the compile cache (single-flight, bounded by
  bytes) and its disk store;
- :mod:`grammar_service.workers`, :mod:`grammar_service.compile_worker`: the
  compile worker processes that keep a slow or hostile compile off the step;
- :mod:`grammar_service.deadlines`: the start deadlines;
- :mod:`grammar_service.transport`: how a step travels between the decode loop
  and the service (the channel, the shared-memory mask buffers).

The threads, processes, sockets and shared memory are here and in
:mod:`grammar_service.transport`; :mod:`grammar_backend` has none of them.
Nothing here knows Triton (:mod:`triton_support` sits above).
"""
