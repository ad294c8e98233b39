"""Triton model ``grammar`` (Python backend, decoupled): a thin adapter over grammar_backend.

Tensor contract (``max_batch_size: 0``; B = rows of the request):

Inputs
    OP               BYTES [1]      start | step | rollback | end | stats | channel
    SEQUENCE_ID      UINT64 [B]     sequence ids (exactly one for start)
    TOKENS           INT32 [B, K]   step: tokens generated since the row's last step
    TOKEN_COUNT      INT32 [B]      step: valid entries of each TOKENS row; rollback: tokens to undo
    GRAMMAR_TYPE     BYTES [1]      start: constraint kind (json_schema, regex, ...)
    GRAMMAR          BYTES [1]      start: constraint payload
    GRAMMAR_OPTIONS  BYTES [1]      start: JSON object of options (optional)
    VALIDATED        BOOL [1]       start: the constraint is preprocessing's validated wire form
                                    (grammar_backend.spec.ConstraintSpec.wire), trusted as is
                                    (optional; absent: validated here)
    JUMP_FORWARD     BOOL [1]       step: also return forced tokens (optional)
    BITMASK_BUFFER   BYTES [1]      step: name of the caller's mask buffer in /dev/shm
                                    (grammar_service.transport.maskbuf): the rows go there, not to BITMASK
                                    (optional)
    MAX_TOKENS       INT32 [1]      start: the request's token budget, for budget closing
                                    (optional; absent or 0: none)
    VALUE_CHECKS     BOOL [1]       start: the caller drops the tokens DROPPED reports, so
                                    completed values are checked (grammar_backend.values;
                                    optional; absent: off)
    DRAFT_TOKENS     INT32 [B, D]   step: draft tokens proposed after each row's new tokens
                                    (speculative decoding; optional, with DRAFT_COUNT)
    DRAFT_COUNT      INT32 [B]      step: valid entries of each DRAFT_TOKENS row

Outputs (exactly one response per request, sent with the FINAL flag; a step's answer is
grammar_backend.protocol.MaskStep, its tensors derived from STEP_FIELDS)
    BITMASK          INT32 [B, ceil(V/32)]  step without BITMASK_BUFFER: mask of each row's next token
    TERMINATED       BOOL [B]               step: the row's grammar accepted its stop token
    ROW_ERROR        BYTES [B]              step/rollback: "" or that row's error (a step sends it
                                            only when a row failed)
    FORCED_TOKENS    INT32 [B, F]           step with JUMP_FORWARD
    FORCED_COUNT     INT32 [B]              step with JUMP_FORWARD
    FORCED_SAFE      INT32 [B]              step with JUMP_FORWARD: of forced tokens that start an
                                            output, how many of the first no value check can drop
    CLOSING          INT8 [B]               step: 0, or the row's mask forces a completion
                                            (1: budget, 2: repetition; grammar_backend.closing)
    DROPPED          INT32 [B]              step: tokens the row's value check dropped (sent only
                                            when a row dropped some)
    HOLD             INT32 [B]              step: the row's last tokens a value check may still
                                            drop (sent only when a row holds some)
    DRAFT_VALID      INT32 [B]              step with drafts: how many of the row's draft masks hold
    DRAFT_CLOSING    INT8 [B, D]            step with drafts: the close state after each held draft
    DRAFT_BITMASK    INT32 [D, B, ceil(V/32)]  step with drafts, without BITMASK_BUFFER: row i's mask
                                            after its drafts 0..j at [j, i] (with a buffer: its rows
                                            B..B+D*B)
    ACTIVE_SEQUENCES INT32 [1]              sequences holding a matcher after this request
    STATS            BYTES [1]              stats: JSON of cache and table counters
    BACKEND          BYTES [1]              start: the grammar backend serving the sequence
                                            (xgrammar or llguidance; grammar option backend)
    CHANNEL          BYTES [1]              channel: the grammar channel's socket path
                                            (grammar_service.transport.channel: start, step and end without BLS)
    ERROR            BYTES [1]              only when requested: a request-level error as data,
                                            JSON {"status": gRPC status name, "message": ...}

A request-level error (bad constraint, compile failure, duplicate start,
malformed batch) is an error response whose code comes from
``grammar_backend.errors.triton_code_name`` -- unless the request asked for
the ERROR output: Triton 2.51's BLS resets every error code to INTERNAL
(triton-inference-server/server#7804), so the ``llm`` model asks for ERROR to
keep INVALID_ARGUMENT distinct from a server fault. One bad row of a step is
only reported in ROW_ERROR.

Starts, steps and ends also come over the grammar channel
(:mod:`grammar_service.transport.channel`), a Unix socket this model listens on from
``initialize``: the same ``GrammarService`` ops, without Triton's request
path; ``channel`` answers its path.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.errors import ServingError, triton_code_name
from grammar_backend.protocol import answer_tensors
from triton_support.metrics import MetricsPump, TritonMetrics
from triton_support.params import from_parameters, parameter_values
from triton_support.service import (
    GrammarModelConfig,
    GrammarReply,
    GrammarRequest,
    GrammarService,
)
from triton_support.teardown import quiesce_for_exit


def _array(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _bytes(request: Any, name: str) -> bytes:
    arr = _array(request, name)
    return b"" if arr is None or arr.size == 0 else bytes(arr.reshape(-1)[0])


def _to_request(request: Any) -> GrammarRequest:
    jump = _array(request, "JUMP_FORWARD")
    validated = _array(request, "VALIDATED")
    budget = _array(request, "MAX_TOKENS")
    checks = _array(request, "VALUE_CHECKS")
    seq_ids = _array(request, "SEQUENCE_ID")
    return GrammarRequest(
        op=_bytes(request, "OP").decode("utf-8", "replace"),
        seq_ids=seq_ids if seq_ids is not None else np.zeros(0, np.uint64),
        tokens=_array(request, "TOKENS"),
        counts=_array(request, "TOKEN_COUNT"),
        grammar_type=_bytes(request, "GRAMMAR_TYPE").decode("utf-8", "replace"),
        grammar=_bytes(request, "GRAMMAR"),
        grammar_options=_bytes(request, "GRAMMAR_OPTIONS"),
        validated=bool(validated is not None and validated.reshape(-1)[0]),
        jump_forward=bool(jump is not None and jump.reshape(-1)[0]),
        mask_buffer=_bytes(request, "BITMASK_BUFFER").decode("utf-8", "replace"),
        budget=0 if budget is None or budget.size == 0 else int(budget.reshape(-1)[0]),
        value_checks=bool(checks is not None and checks.reshape(-1)[0]),
        drafts=_array(request, "DRAFT_TOKENS"),
        draft_counts=_array(request, "DRAFT_COUNT"),
    )


def _to_response(reply: GrammarReply, wanted: frozenset[str]) -> Any:
    # Only the outputs the caller asked for (all when it named none): an output
    # the stub must prune is deleted in ResponseSender::Send with the GIL
    # released, which frees its numpy array off the GIL and corrupts the heap
    # on Triton 2.51 (python_backend PR 390, fixed in 24.12).
    candidates: list[tuple[str, Any]] = [("ACTIVE_SEQUENCES", np.array([reply.active], np.int32))]
    if reply.step is not None:
        candidates += answer_tensors(reply.step, with_bitmask=not reply.bitmask_in_buffer)
    if reply.row_errors:
        candidates.append(("ROW_ERROR", np.array([e.encode() for e in reply.row_errors], np.object_)))
    if reply.stats is not None:
        candidates.append(("STATS", np.array([reply.stats.encode()], np.object_)))
    if reply.backend is not None:
        candidates.append(("BACKEND", np.array([reply.backend.encode()], np.object_)))
    if reply.channel is not None:
        candidates.append(("CHANNEL", np.array([reply.channel.encode()], np.object_)))
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, value) for name, value in candidates if not wanted or name in wanted])


def _error_response(err: ServingError, as_data: bool) -> Any:
    if as_data:
        doc = json.dumps({"status": err.status, "message": str(err)}).encode()
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("ERROR", np.array([doc], np.object_))])
    code = getattr(pb_utils.TritonError, triton_code_name(err))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err), code))


class TritonPythonModel:
    """Adapter: pb_utils requests -> GrammarService -> pb_utils responses."""

    def initialize(self, args: dict[str, str]) -> None:
        config = from_parameters(GrammarModelConfig, parameter_values(json.loads(args["model_config"])), "grammar")
        self.service = GrammarService(config.build_engine())
        # Ready means the compile workers run: the first compiles do not pay their start-up.
        self.service.engine.warm_up()
        # Starts are parsed here, off the step path (a huge schema's parse is
        # slow). Eight threads, so a small constraint's start interleaves
        # with big parses instead of queuing behind them; their compiles run
        # in worker processes and answer through a callback, so a slow
        # compile holds none of these threads.
        self.starts = ThreadPoolExecutor(8, thread_name_prefix="grammar-start")
        # The grammar metrics of triton_support.metrics on Triton's endpoint, published by a
        # thread of their own: soon after starts and ends (gauges that move), and each second.
        self.metrics = TritonMetrics(pb_utils, "grammar")
        self.pump = MetricsPump(self.metrics, self.service.metrics_snapshot)
        self.service.open_channel(on_served=self._after_op)

    def _after_op(self, op: str) -> None:
        if op != "step":
            self.pump.changed()

    def _serve(self, request: Any, req: GrammarRequest, errors_as_data: bool) -> None:
        try:
            outcome: GrammarReply | Exception = self.service.handle(req)
        except Exception as err:  # noqa: BLE001 - sent to the caller by _send, never swallowed
            outcome = err
        self._send(request, req.op, outcome, errors_as_data)

    def _start(self, request: Any, req: GrammarRequest, errors_as_data: bool) -> None:
        try:
            self.service.start_async(req, lambda outcome: self._send(request, "start", outcome, errors_as_data))
        except Exception as err:  # noqa: BLE001 - sent to the caller by _send, never swallowed
            self._send(request, "start", err, errors_as_data)

    def _send(self, request: Any, op: str, outcome: GrammarReply | Exception, errors_as_data: bool) -> None:
        if isinstance(outcome, GrammarReply):
            response = _to_response(outcome, frozenset(request.requested_output_names()))
        elif isinstance(outcome, ServingError):
            response = _error_response(outcome, errors_as_data)
        else:  # a bug must reach the caller as INTERNAL, never hang it
            pb_utils.Logger.log_error(f"grammar: {op} failed: {outcome!r}")
            response = pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"grammar: internal error in {op}: {outcome!r}", pb_utils.TritonError.INTERNAL)
            )
        request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._after_op(op)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            req = _to_request(request)
            errors_as_data = "ERROR" in request.requested_output_names()
            if req.op == "start":
                self.starts.submit(self._start, request, req, errors_as_data)
            else:
                self._serve(request, req, errors_as_data)

    def finalize(self) -> None:
        self.service.close_channel()
        self.starts.shutdown(wait=False, cancel_futures=True)
        self.service.engine.close()
        # pb_utils objects are freed while the stub is still up (see the llm model).
        self.pump.close()
        self.metrics.close()
        quiesce_for_exit()
