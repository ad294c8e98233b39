"""Triton model ``llm`` (Python backend, decoupled): a thin adapter over llm_runtime.Scheduler.

Tensor contract (``max_batch_size: 0``):

Inputs
    INPUT_IDS   INT32 [T]   prompt token ids (from preprocessing)
    REQUEST     BYTES [1]   validated parameters + canonical constraint (JSON, from preprocessing)
    CANCEL      BYTES [1]   alone: cancel the in-flight request whose Triton request id this is
                            (answered with an empty final response). Triton 2.51 does not pass a
                            client's stream cancellation into ensemble steps (server#6739), so
                            the client SDK sends this when a stream is closed early.
Outputs (streamed; the last response carries the FINAL flag)
    TEXT_DELTA  BYTES [1]   UTF-8 text of the tokens since the previous response
    FINISH      BYTES [1]   "" until the last response; then a JSON object {finish_reason, text,
                            prompt_tokens, completion_tokens, error, constraint} (the constraint
                            rides on the last response only, so postprocessing can validate
                            without a copy of the schema on every streamed token)

Each request joins the in-flight batch at a step boundary. Per step, one BLS
request to ``grammar`` computes the bitmask of every constrained row while
the batched forward runs. A constraint that fails to compile before any
token is an error response with its code (INVALID_ARG for a bad constraint).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from grammar_backend.errors import TRITON_CODE_NAMES, GrammarError, InvalidArgument
from grammar_backend.params import from_parameters, parameter_values
from llm_runtime.mask import ConstraintRequest
from llm_runtime.model_config import LlmModelConfig, bls_scheduler, stats_summary
from llm_runtime.postprocess import FinalState
from llm_runtime.preprocess import GenerationParams
from llm_runtime.scheduler import FinishEvent, GenerationRequest, TokenEvent

_EMPTY = np.array([b""], np.object_)


def _error(message: str, status: str) -> Any:
    code = getattr(pb_utils.TritonError, TRITON_CODE_NAMES.get(status, "INTERNAL"))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _to_request(request: Any) -> tuple[dict[str, str] | None, GenerationRequest]:
    ids_tensor = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS")
    raw_tensor = pb_utils.get_input_tensor_by_name(request, "REQUEST")
    if ids_tensor is None or raw_tensor is None:
        raise InvalidArgument("INPUT_IDS", "INPUT_IDS and REQUEST are required unless CANCEL is given")
    ids = ids_tensor.as_numpy().reshape(-1)
    raw = raw_tensor.as_numpy().reshape(-1)[0]
    params = GenerationParams.from_json(bytes(raw))
    c = params.constraint
    return c, GenerationRequest(
        prompt_token_ids=ids.tolist(),
        # The ensemble passes the client's request id down: it is what CANCEL names.
        request_id=request.request_id() or None,
        constraint=None if c is None else ConstraintRequest(c["kind"], c["payload"], c["options"]),
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop=params.stop,
    )


class _Stream:
    """Sends one request's scheduler events as Triton responses."""

    __slots__ = ("constraint", "metrics", "rid", "scheduler", "sender")

    def __init__(self, sender: Any, scheduler: Any, metrics: dict[str, Any]) -> None:
        self.sender = sender
        self.scheduler = scheduler
        self.metrics = metrics
        self.rid = ""
        self.constraint: dict[str, str] | None = None

    def __call__(self, event: TokenEvent | FinishEvent) -> None:
        if isinstance(event, TokenEvent):
            # The client closed its stream: free the sequence at the next step.
            if self.sender.is_cancelled():
                self.scheduler.cancel(self.rid)
            elif event.text_delta:
                self.sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("TEXT_DELTA", np.array([event.text_delta.encode("utf-8")], np.object_)),
                    pb_utils.Tensor("FINISH", _EMPTY)]))
            return
        self.metrics["max_batch"].set(self.scheduler.max_batch_size_seen)
        self.metrics["live"].set(self.scheduler.live_count)
        if event.error_status == "CANCELLED":
            self.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        elif event.error is not None and event.completion_tokens == 0 and event.error_status != "INTERNAL":
            self.sender.send(_error(event.error, event.error_status), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            final = FinalState(event.finish_reason, event.text, event.prompt_tokens, event.completion_tokens,
                               event.error)
            finish = json.dumps({**dataclasses.asdict(final), "constraint": self.constraint}, ensure_ascii=False)
            self.sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("TEXT_DELTA", _EMPTY),
                pb_utils.Tensor("FINISH", np.array([finish.encode("utf-8")], np.object_))]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonPythonModel:
    """Adapter: Triton requests -> Scheduler.submit; scheduler events -> streamed responses."""

    def initialize(self, args: dict[str, str]) -> None:
        config = from_parameters(LlmModelConfig, parameter_values(json.loads(args["model_config"])), "llm")
        self.scheduler = bls_scheduler(config, pb_utils)
        # Prometheus gauges on Triton's metrics endpoint, updated once per finished request.
        # The families must outlive their metrics, so they are kept too.
        gauge = pb_utils.MetricFamily.GAUGE
        self.families = {
            "max_batch": pb_utils.MetricFamily("llm_batch_size_max", "Largest batch decoded in one step", gauge),
            "live": pb_utils.MetricFamily("llm_live_requests", "Requests not finished yet", gauge),
        }
        self.metrics = {name: family.Metric() for name, family in self.families.items()}

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            cancel = pb_utils.get_input_tensor_by_name(request, "CANCEL")
            if cancel is not None:
                self.scheduler.cancel(bytes(cancel.as_numpy().reshape(-1)[0]).decode("utf-8", "replace"))
                request.get_response_sender().send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            stream = _Stream(request.get_response_sender(), self.scheduler, self.metrics)
            try:
                stream.constraint, gen_request = _to_request(request)
                stream.rid = self.scheduler.submit(gen_request, stream)
            except GrammarError as err:
                stream.sender.send(_error(str(err), err.status), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        # One line per process lifetime: the per-step figures the benchmarks read.
        pb_utils.Logger.log_info(f"llm step stats: {json.dumps(stats_summary(self.scheduler))}")
        self.scheduler.close()
