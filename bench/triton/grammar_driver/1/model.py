"""Bench-only Triton model: times ``grammar`` steps over BLS, as the ``llm`` model makes them.

Tensor contract (``max_batch_size: 0``)

Inputs
    CONFIG  BYTES [1]  JSON {"constraints": [[kind, payload, options], ...], "paths": [[token ids], ...],
                       "rows": B, "jump_forward": bool, "buffer": bool}: row ``r`` follows
                       constraint and path ``r % len(paths)``; every row feeds its path's next
                       token per step; ``buffer``: masks through a shared-memory mask buffer
                       (from the second step on, as in the llm model) instead of BLS tensors
Outputs
    RESULT  BYTES [1]  JSON {"step_s": [seconds of each step's call, blocking until its answer is read],
                       "arrival_s": [seconds from each step's send to its reply's arrival (the kernel's
                       receive stamp, what the llm model's decode loop waits on after its forward); a
                       step over BLS: its call]}
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from llm_runtime.mask import ConstraintRequest
from llm_runtime.remote_mask import RemoteMaskProvider


class TritonPythonModel:
    """Adapter: one CONFIG -> start B sequences, step them along their paths, end them."""

    def _run(self, cfg: dict[str, Any]) -> dict[str, Any]:
        rows = int(cfg["rows"])
        provider = RemoteMaskProvider(pb_utils, max_rows=rows if cfg.get("buffer") else 0)
        try:
            return self._steps(provider, cfg, rows)
        finally:
            provider.close()

    def _steps(self, provider: RemoteMaskProvider, cfg: dict[str, Any], rows: int) -> dict[str, Any]:
        paths = [list(map(int, p)) for p in cfg["paths"]]
        constraints = [ConstraintRequest(k, p, o) for k, p, o in cfg["constraints"]]
        ids = np.array([secrets.randbits(63) + 1 for _ in range(rows)], np.uint64)
        for r in range(rows):
            provider.start(int(ids[r]), constraints[r % len(constraints)])
        steps = min(len(p) for p in paths)
        tokens = np.zeros((rows, 1), np.int32)
        counts = np.zeros(rows, np.int32)
        jump = bool(cfg.get("jump_forward"))
        times: list[float] = []
        arrivals: list[float] = []
        try:
            for i in range(steps):
                t0 = time.perf_counter()
                # As the llm model: send, then take the answer (there after its forward).
                pending = provider.send_step(ids, tokens, counts, jump_forward=jump)
                if pending is None:
                    out = provider.step(ids, tokens, counts, jump_forward=jump)
                    arrival = time.perf_counter() - t0
                else:
                    out, arrival = pending.result()
                times.append(time.perf_counter() - t0)
                arrivals.append(arrival)
                bad = [e for e in out.errors if e is not None]
                if bad:
                    raise RuntimeError(f"step {i}: {bad[0]}")
                for r in range(rows):
                    tokens[r, 0] = paths[r % len(paths)][i]
                counts.fill(1)
        finally:
            provider.end([int(s) for s in ids])
        return {"step_s": times, "arrival_s": arrivals}

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            cfg = json.loads(bytes(pb_utils.get_input_tensor_by_name(request, "CONFIG").as_numpy().reshape(-1)[0]))
            try:
                doc = json.dumps(self._run(cfg)).encode()
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("RESULT", np.array([doc], np.object_))]))
            except Exception as err:  # noqa: BLE001 -- reported to the bench as the response's error
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(repr(err))))
        return responses
