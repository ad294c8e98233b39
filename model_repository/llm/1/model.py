"""Triton model ``llm`` (Python backend, decoupled): a thin adapter over an llm_runtime generator.

The generator is :class:`llm_runtime.scheduler.Scheduler` (``engine: torch``)
or :class:`llm_runtime.trtllm_engine.TrtllmGenerator` (``engine: tensorrt_llm``),
chosen by :class:`llm_runtime.model_config.LlmModelConfig`.

Tensor contract (``max_batch_size: 0``):

Inputs
    INPUT_IDS   INT32 [T]   prompt token ids (from preprocessing)
    REQUEST     BYTES [1]   validated parameters + canonical constraint (JSON, from preprocessing)
    CANCEL      BYTES [1]   alone: cancel the in-flight request whose Triton request id this is
                            (answered with an empty final response). Triton 2.51 does not pass a
                            client's stream cancellation into ensemble steps (server#6739), so
                            the gateway sends this when its client closes a stream early.
Outputs (streamed; the last response carries the FINAL flag)
    TEXT_DELTA  BYTES [1]   UTF-8 text of the tokens since the previous response (the first
                            goes out at once, then one at most every stream_interval_ms:
                            llm_runtime.streaming; the last one carries what is left); with a
                            thinking section (REQUEST reasoning), the answer's text only
    REASONING_DELTA BYTES [1] the thinking section's text since the previous response ("" without
                            one; contract.reasoning.ReasoningSplitter, markers left out)
    FINISH      BYTES [1]   "" until the last response; then a JSON object: the generator's
                            contract.finish.FinishEvent {finish_reason, text, prompt_tokens,
                            completion_tokens, error, status, close_reason, stop_string, backend,
                            value_retries, value_dropped_tokens, reasoning_tokens, reasoning_cut}
                            plus constraint (the constraint rides on the last response only, so
                            postprocessing can validate without a copy of the schema on every
                            streamed token) and, with a thinking section, reasoning
    TOKEN_LOGPROBS BYTES [1] "" unless the request asked for log probabilities (REQUEST logprobs);
                            then a JSON array of OpenAI chat logprobs.content entries {token,
                            logprob, bytes, top_logprobs: [{token, logprob, bytes}]}, one per
                            output token the generator delivered since the previous response
                            (llm_runtime.logprobs; its text may come in a later response, where
                            the detokenizer holds back part of a character or of a stop string)

Each request joins the in-flight batch at a step boundary. Per step, one
request to ``grammar`` (over its channel, llm_runtime.remote_mask) computes the
bitmask of every constrained row while the batched forward runs. Every failure -- a request preprocessing refused, a
constraint that fails to compile, an overloaded scheduler -- ends with one final
FINISH carrying ``finish_reason: "error"`` and its gRPC status name: this model
never sends an error response (see pipeline.postprocess and deploy/gateway.py).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.errors import InvalidArgument, ServingError
from contract.finish import FinishEvent
from contract.reasoning import Reasoning
from llm_runtime.logprobs import TokenText, logprobs_json
from llm_runtime.mask import ConstraintRequest
from llm_runtime.model_config import LlmModelConfig, served_generator
from llm_runtime.scheduler import GenerationRequest
from llm_runtime.streaming import Outbox, ResponseStream, StreamPart
from pipeline.finish import finish_json
from pipeline.preprocess import GenerationParams
from triton_support.metrics import TritonMetrics
from triton_support.params import from_parameters, parameter_values
from triton_support.teardown import quiesce_for_exit

_EMPTY = np.array([b""], np.object_)


def _to_request(request: Any) -> tuple[dict[str, str] | None, Reasoning | None, GenerationRequest]:
    ids_tensor = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS")
    raw_tensor = pb_utils.get_input_tensor_by_name(request, "REQUEST")
    if ids_tensor is None or raw_tensor is None:
        raise InvalidArgument("INPUT_IDS", "INPUT_IDS and REQUEST are required unless CANCEL is given")
    ids = ids_tensor.as_numpy().reshape(-1)
    raw = raw_tensor.as_numpy().reshape(-1)[0]
    params = GenerationParams.from_json(bytes(raw))
    c = params.constraint
    return c, params.reasoning, GenerationRequest(
        prompt_token_ids=ids.tolist(),
        # The ensemble passes the request id down (the gateway's 128-bit internal id): CANCEL names it.
        request_id=request.request_id() or None,
        # Preprocessing validated the constraint (its wire form): the grammar side trusts it.
        constraint=None if c is None else ConstraintRequest(c["kind"], c["payload"], c["options"], validated=True),
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop=params.stop,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        min_p=params.min_p,
        logprobs=params.logprobs,
        draft_tokens=params.draft_tokens,
    )


class _Responses:
    """One request's response sender: :class:`StreamPart` s to ``pb_utils`` responses (llm_runtime.streaming's sink).

    Runs on the outbox's thread only.
    """

    __slots__ = ("constraint", "reasoning", "rid", "scheduler", "sender", "token_text")

    def __init__(self, sender: Any, scheduler: Any, token_text: TokenText) -> None:
        self.sender = sender
        self.scheduler = scheduler
        self.token_text = token_text  # the model's one instance: used on the outbox's thread only
        self.rid = ""
        self.constraint: dict[str, str] | None = None
        self.reasoning: Reasoning | None = None

    def poll_cancel(self) -> None:
        # The client closed its stream: free the sequence at the next step.  Inside the ensemble
        # Triton 2.51 never sets it anyway (server#6739: the gateway sends CANCEL).
        if self.sender.is_cancelled():
            self.scheduler.cancel(self.rid)

    def send_cancelled(self) -> None:
        self._send(None, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def send_part(self, part: StreamPart) -> None:
        if part.final is None:
            finish, flags = _EMPTY, 0
        else:
            # Errors are data in FINISH (pipeline.postprocess), never an error response.
            text = finish_json(part.final, self.constraint, self.reasoning).encode("utf-8")
            finish, flags = np.array([text], np.object_), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if part.logprobs is None:
            lps = _EMPTY
        else:
            lps = np.array([logprobs_json(part.logprobs, self.token_text).encode("utf-8")], np.object_)
        self._send(pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("TEXT_DELTA", np.array([part.text.encode("utf-8")], np.object_)),
            pb_utils.Tensor("REASONING_DELTA", np.array([part.thinking.encode("utf-8")], np.object_)),
            pb_utils.Tensor("FINISH", finish), pb_utils.Tensor("TOKEN_LOGPROBS", lps)]), flags)

    def _send(self, response: Any, flags: int) -> None:
        try:
            if response is None:
                self.sender.send(flags=flags)
            else:
                self.sender.send(response, flags=flags)
        except Exception as err:  # noqa: BLE001 -- the stream is gone: its request stops at the next step
            pb_utils.Logger.log_error(f"llm: a response of request {self.rid} could not be sent: {err!r}")
            if self.rid:
                self.scheduler.cancel(self.rid)


class TritonPythonModel:
    """Adapter: Triton requests -> Scheduler.submit; scheduler events -> streamed responses."""

    def initialize(self, args: dict[str, str]) -> None:
        config = from_parameters(LlmModelConfig, parameter_values(json.loads(args["model_config"])), "llm")
        self.stream_interval_s = config.stream_interval_ms / 1000.0
        # The llm metrics of triton_support.metrics on Triton's endpoint; the
        # generator hands snapshots over when a gauge moves (or each second).
        self.metrics = TritonMetrics(pb_utils, "llm")
        # Every response is sent from this one thread, never from the decode loop (llm_runtime.streaming).
        self.outbox = Outbox()
        # Metric snapshots are published from the outbox too: a publication is
        # IPC with tritonserver, which the decode loop must not wait for.
        self.scheduler, self.provider = served_generator(
            config, pb_utils, lambda snap: self.outbox.put(functools.partial(self.metrics.publish, snap, force=True)))
        # Token ids -> text and bytes for TOKEN_LOGPROBS (cached per id; used on the outbox's thread).
        self.token_text = TokenText(self.scheduler.tokenizer)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            cancel = pb_utils.get_input_tensor_by_name(request, "CANCEL")
            if cancel is not None:
                self.scheduler.cancel(bytes(cancel.as_numpy().reshape(-1)[0]).decode("utf-8", "replace"))
                request.get_response_sender().send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            sink = _Responses(request.get_response_sender(), self.scheduler, self.token_text)
            stream = ResponseStream(sink, self.outbox, self.stream_interval_s)
            try:
                sink.constraint, sink.reasoning, gen_request = _to_request(request)
                stream = ResponseStream(sink, self.outbox, self.stream_interval_s, reasoning=sink.reasoning,
                                        logprobs=gen_request.logprobs is not None)
                sink.rid = self.scheduler.submit(gen_request, stream)
            except ServingError as err:
                stream.finish(FinishEvent.rejected(err))
            except Exception as err:  # noqa: BLE001 - a bug: INTERNAL as data, never an error response
                pb_utils.Logger.log_error(f"llm: request failed: {err!r}")
                stream.finish(FinishEvent.rejected(err))

    def finalize(self) -> None:
        # One line per process lifetime: the per-step figures the benchmarks read.
        pb_utils.Logger.log_info(f"llm step stats: {json.dumps(self.scheduler.summary())}")
        self.scheduler.close()
        self.outbox.close()  # the final responses of the requests the close failed
        self.provider.close()
        # Every pb_utils object (metrics before their families, the BLS responses
        # the provider retains or exception tracebacks hold) is freed
        # here, while the stub's shared memory still exists: left to interpreter
        # teardown their destructors segfaulted the stub on SIGTERM shutdowns
        # (MetricFamily 2 of 2; PbTensor and InferResponse once each).
        del self.scheduler, self.provider, self.outbox
        self.metrics.close()
        quiesce_for_exit()
