"""Triton model ``preprocessing`` (Python backend): a thin adapter over pipeline.preprocess.

Decoupled, with two lanes: a request is checked and tokenized on the stub's
thread and answered at once, unless its constraint is large and new
(``Preprocessor.heavy``); then its constraint is checked in the heavy lane
(``pipeline.lane.HeavyLane``: one thread, which hands the check to a child
process at nice 19, ``pipeline.checker.Checker``), which answers it, so
requests behind it never wait for its checks.  Each request gets exactly
one response, sent with the final flag.

Tensor contract (``max_batch_size: 0``; all inputs optional, exactly one of PROMPT/MESSAGES):

Inputs
    PROMPT           BYTES [1]   user text (the chat template is applied here)
    MESSAGES         BYTES [1]   JSON array of {role, content}
    GRAMMAR_TYPE     BYTES [1]   json_schema | json_object | regex | ebnf | lark | choice | structural_tag
    GRAMMAR          BYTES [1]   the constraint payload
    GRAMMAR_OPTIONS  BYTES [1]   JSON object: strict, whitespace, indent, any_order
    MAX_TOKENS INT32 [1], TEMPERATURE FP32 [1], TOP_P FP32 [1], TOP_K INT32 [1], SEED UINT64 [1]
    REPETITION_PENALTY, FREQUENCY_PENALTY, PRESENCE_PENALTY, MIN_P   FP32 [1] (contract.PENALTY_FIELDS)
    STOP             BYTES [N]   stop strings
    REASONING        BYTES [1]   JSON: true, false or {start, end, max_reasoning_tokens} (contract.reasoning)
    LOGPROBS         INT32 [1]   alternatives to report per output token, 0..contract.MAX_TOP_LOGPROBS
                                 (absent: no log probabilities; contract.check_logprobs)
    DRAFT_TOKENS     INT32 [1]   prompt-lookup speculation: most draft tokens a step, 0..contract.MAX_DRAFT_TOKENS
                                 (0: off; absent: the llm model's draft_tokens; contract.check_draft_tokens)
Outputs
    INPUT_IDS        INT32 [T]   prompt token ids ([0] when the request is refused)
    REQUEST          BYTES [1]   validated parameters + canonical constraint (JSON), or
                                 {"rejected": {"status", "message"}} naming the field and the reason

A refused request is data, never an error response (see pipeline.postprocess):
``llm`` answers it with one final error RESULT.  A full heavy lane refuses
with RESOURCE_EXHAUSTED (``pipeline.lane.LaneFull``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

import contract
from contract.errors import ServingError
from pipeline.checker import Checker
from pipeline.lane import HeavyLane, LaneClosed
from pipeline.preprocess import (
    Pending,
    PreprocessConfig,
    Preprocessor,
    RawRequest,
    RequestConstraint,
    rejection_json,
)
from triton_support.params import from_parameters, parameter_values
from triton_support.teardown import quiesce_for_exit


def _first(request: Any, name: str) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    arr = tensor.as_numpy().reshape(-1)
    if not arr.size:
        return None
    value = arr[0]
    return value.item() if isinstance(value, np.generic) else value


def _to_raw(request: Any) -> RawRequest:
    stop = pb_utils.get_input_tensor_by_name(request, "STOP")
    return RawRequest(
        prompt=_first(request, "PROMPT"),
        messages=_first(request, "MESSAGES"),
        grammar_type=_first(request, "GRAMMAR_TYPE"),
        grammar=_first(request, "GRAMMAR"),
        grammar_options=_first(request, "GRAMMAR_OPTIONS"),
        max_tokens=_first(request, "MAX_TOKENS"),
        temperature=_first(request, "TEMPERATURE"),
        top_p=_first(request, "TOP_P"),
        top_k=_first(request, "TOP_K"),
        seed=_first(request, "SEED"),
        stop=() if stop is None else tuple(bytes(s) for s in stop.as_numpy().reshape(-1)),
        **{name: _first(request, name.upper()) for name in contract.PENALTY_FIELDS},
        reasoning=_first(request, "REASONING"),
        logprobs=_first(request, "LOGPROBS"),
        draft_tokens=_first(request, "DRAFT_TOKENS"),
    )


def _send(sender: Any, ids: list[int], request_json: str) -> None:
    sender.send(pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("INPUT_IDS", np.array(ids, np.int32)),
        pb_utils.Tensor("REQUEST", np.array([request_json.encode("utf-8")], np.object_)),
    ]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _refused(err: BaseException) -> tuple[list[int], str]:
    if not isinstance(err, ServingError):  # a bug: INTERNAL as data, never an error response
        pb_utils.Logger.log_error(f"preprocessing failed: {err!r}")
    return [], rejection_json(err)


class TritonPythonModel:
    """Adapter: ensemble request fields -> Preprocessor -> INPUT_IDS, REQUEST (one final response each)."""

    def initialize(self, args: dict[str, str]) -> None:
        config = from_parameters(PreprocessConfig, parameter_values(json.loads(args["model_config"])), "preprocessing")
        self.preprocess = Preprocessor.from_config(config)
        self.checker = Checker(config.heavy_cpu_s)
        self.lane: HeavyLane[tuple[Pending, Any]] = HeavyLane("preprocessing", config.heavy_queue, self._heavy)

    def _answer(self, pending: Pending, sender: Any, check: Callable[[RequestConstraint], None] | None) -> None:
        try:
            ids, params = self.preprocess.complete(pending, check)
            answer = ids, params.to_json()
        except Exception as err:  # noqa: BLE001 - every refusal and bug is answered as data
            answer = _refused(err)
        _send(sender, *answer)

    def _heavy(self, item: tuple[Pending, Any]) -> None:
        """The heavy lane's work: the constraint checked in the child process first."""
        self._answer(*item, self.checker.check)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                pending = self.preprocess.prepare(_to_raw(request))
                if self.preprocess.heavy(pending):
                    self.lane.submit((pending, sender))  # answered by the lane's thread
                    continue
            except Exception as err:  # noqa: BLE001 - every refusal and bug is answered as data
                _send(sender, *_refused(err))
                continue
            self._answer(pending, sender, None)

    def finalize(self) -> None:
        self.checker.close()  # a check in progress ends (its request is answered INTERNAL)
        for _, sender in self.lane.close(timeout_s=60.0):
            _send(sender, *_refused(LaneClosed(self.lane.closed_message)))
        quiesce_for_exit()
