"""Stand-ins that tests and benchmarks drive instead of a real language model, never imported by the product.

* :mod:`standins.tiny_model`: a tiny, random, but real Hugging Face Llama checkpoint (a few-ms forward).
* :mod:`standins.scripted`: a scripted "model" writing a fixed output through the real grammar engine's masks.
"""
