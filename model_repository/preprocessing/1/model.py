"""Triton model ``preprocessing`` (Python backend): a thin adapter over llm_runtime.preprocess.

Tensor contract (``max_batch_size: 0``; all inputs optional, exactly one of PROMPT/MESSAGES):

Inputs
    PROMPT           BYTES [1]   user text (the chat template is applied here)
    MESSAGES         BYTES [1]   JSON array of {role, content}
    GRAMMAR_TYPE     BYTES [1]   json_schema | json_object | regex | ebnf | lark | choice | structural_tag
    GRAMMAR          BYTES [1]   the constraint payload
    GRAMMAR_OPTIONS  BYTES [1]   JSON object: strict, whitespace, indent, any_order
    MAX_TOKENS INT32 [1], TEMPERATURE FP32 [1], TOP_P FP32 [1], TOP_K INT32 [1], SEED UINT64 [1]
    STOP             BYTES [N]   stop strings
Outputs
    INPUT_IDS        INT32 [T]   prompt token ids
    REQUEST          BYTES [1]   validated parameters + canonical constraint (JSON)

A bad field is an INVALID_ARG error naming the field and the reason.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from grammar_backend.errors import GrammarError, triton_code_name
from grammar_backend.params import from_parameters, parameter_values
from llm_runtime.preprocess import PreprocessConfig, Preprocessor, RawRequest


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
    )


class TritonPythonModel:
    """Adapter: ensemble request fields -> Preprocessor -> INPUT_IDS, REQUEST."""

    def initialize(self, args: dict[str, str]) -> None:
        config = from_parameters(PreprocessConfig, parameter_values(json.loads(args["model_config"])), "preprocessing")
        self.preprocess = Preprocessor.from_config(config)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                ids, params = self.preprocess(_to_raw(request))
            except GrammarError as err:
                code = getattr(pb_utils.TritonError, triton_code_name(err))
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err), code)))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("INPUT_IDS", np.array(ids, np.int32)),
                pb_utils.Tensor("REQUEST", np.array([params.to_json().encode("utf-8")], np.object_)),
            ]))
        return responses
