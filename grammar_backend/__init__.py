"""grammar_backend: the grammar core.

Constraints (:mod:`~grammar_backend.spec`), their compile
(:mod:`~grammar_backend.compile`) over xgrammar and llguidance, one sequence's
matcher and the policies it carries (:mod:`~grammar_backend.sequences`:
thinking, value checks, closing, jump-forward), bitmasks, fidelity, and the
step protocol (:mod:`~grammar_backend.protocol`): what a step answers.

Pure computation: no sockets, threads, processes or shared memory (the
import test ``tests/unit/test_deploy_imports.py`` forbids them).  Serving it
to many sequences at once is :mod:`grammar_service`; nothing here knows Triton.
"""
