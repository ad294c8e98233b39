"""Triton model ``postprocessing`` (Python backend): a thin adapter over pipeline.postprocess.

Tensor contract (``max_batch_size: 0``), one request per ``llm`` response:

Inputs
    TEXT_DELTA     BYTES [1]  UTF-8 text delta of this response (the answer's, with a thinking section)
    REASONING_DELTA BYTES [1] UTF-8 delta of the thinking section ("" without one)
    FINISH         BYTES [1]  "" on intermediate responses; on the last one a JSON object
                              {finish_reason, text, prompt_tokens, completion_tokens, error, constraint}
    TOKEN_LOGPROBS BYTES [1]  "" unless the request asked for log probabilities; then the JSON array of
                              the entries of the tokens llm delivered since its previous response
Outputs
    TEXT           BYTES [1]  the text delta, passed through
    REASONING_TEXT BYTES [1]  the thinking delta, passed through; sent only when not empty, so the
                              responses of a request without a thinking section are as they were
    FINISH_REASON  BYTES [1]  "" or stop | length | error
    RESULT         BYTES [1]  "" or the final result JSON (docs/usage.md, "Responses and RESULT"); errors are
                              data here (finish_reason "error", status, error), never an error response
    TOKEN_LOGPROBS BYTES [1]  the entries, passed through; sent only for a request that asked for them
                              (on each of its responses, "[]" when it has none), so the responses of
                              other requests are as they were
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.postprocess import FinishedOutput, result_of_finish
from telemetry import Snapshot
from triton_support.metrics import TritonMetrics
from triton_support.teardown import quiesce_for_exit

_EMPTY = np.array([b""], np.object_)


def _bytes(request: Any, name: str) -> bytes:
    return bytes(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])


class TritonPythonModel:
    """Adapter: one llm response in, one ensemble response out."""

    def initialize(self, args: dict[str, str]) -> None:
        # Cumulative output counters (triton_support.metrics), published after each finished output.
        self.metrics = TritonMetrics(pb_utils, "postprocessing")
        self.counts = Snapshot()

    def _count(self, out: FinishedOutput) -> None:
        self.counts.add("constrained_llm_outputs_total", finish_reason=out.finish_reason, kind=out.kind)
        if out.close_reason is not None:
            self.counts.add("constrained_llm_closed_outputs_total", close_reason=out.close_reason, kind=out.kind)
        if out.postvalidation_failed:
            self.counts.add("constrained_llm_postvalidation_failures_total", kind=out.kind)
        self.metrics.publish(self.counts, force=True)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            text = pb_utils.Tensor("TEXT", np.array([_bytes(request, "TEXT_DELTA")], np.object_))
            thinking = _bytes(request, "REASONING_DELTA")
            parts = [text]
            if thinking:
                parts.append(pb_utils.Tensor("REASONING_TEXT", np.array([thinking], np.object_)))
            logprobs = _bytes(request, "TOKEN_LOGPROBS")
            if logprobs:
                parts.append(pb_utils.Tensor("TOKEN_LOGPROBS", np.array([logprobs], np.object_)))
            finish = _bytes(request, "FINISH")
            if not finish:
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    *parts, pb_utils.Tensor("FINISH_REASON", _EMPTY), pb_utils.Tensor("RESULT", _EMPTY)]))
                continue
            out = result_of_finish(finish)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                *parts,
                pb_utils.Tensor("FINISH_REASON", np.array([out.finish_reason.encode()], np.object_)),
                pb_utils.Tensor("RESULT", np.array([out.result.encode("utf-8")], np.object_)),
            ]))
            self._count(out)
        return responses

    def finalize(self) -> None:
        self.metrics.close()
        quiesce_for_exit()
