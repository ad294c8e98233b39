"""The OpenAI-compatible HTTP endpoint (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``).

Floors: it builds requests with the client SDK (:mod:`client`), so every
rule a gRPC client obeys holds here too, and it reaches the ensemble through
the gateway (:mod:`deploy.gateway`), which the launcher wires in
(``--openai-port``).
"""
