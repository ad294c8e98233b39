"""MaskProvider of the served ``grammar`` model: the ``llm`` model asks it for masks over its channel.

The module takes the ``triton_python_backend_utils`` module as an argument
instead of importing it, so the package stays importable (and type-checked)
outside the Python-backend stub.  Starts, steps and ends go over the
grammar model's channel (:mod:`grammar_service.transport.channel`), asked for once
over BLS: the same requests and replies, without Triton's request path
(its cost: :mod:`grammar_service.transport.channel`).  Steps take their
masks through a shared-memory buffer (:mod:`grammar_service.transport.maskbuf`) whose
width the first step (over BLS) gives.  Where the channel cannot be opened
the calls go over BLS, said in the log: the ``grammar`` model is decoupled
(starts compile on its worker threads), so each request yields exactly one
response.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from grammar_backend.errors import INTERNAL, UNAVAILABLE, GrammarError, RemoteGrammarError
from grammar_backend.protocol import (
    BITMASK_TENSOR,
    DRAFT_BITMASK_TENSOR,
    DRAFT_TENSORS,
    JUMP_TENSORS,
    STEP_TENSORS,
    answer_from_tensors,
)
from grammar_service.transport.channel import ChannelClient
from grammar_service.transport.maskbuf import MaskBuffer
from llm_runtime.mask import ConstraintRequest, MaskStep

_log = logging.getLogger(__name__)

# Every call asks for ERROR: the grammar model then returns request-level
# errors as data, because Triton 2.51's BLS resets error codes to INTERNAL
# (triton-inference-server/server#7804) and a bad constraint must reach the
# client as INVALID_ARGUMENT.
_CONTROL_OUTPUTS = ["ACTIVE_SEQUENCES", "ERROR"]
_START_OUTPUTS = [*_CONTROL_OUTPUTS, "BACKEND"]
_CHANNEL_OUTPUTS = [*_CONTROL_OUTPUTS, "CHANNEL"]
#: After the grammar channel failed, the soonest the provider asks for it again (calls go over BLS meanwhile).
CHANNEL_RETRY_S = 5.0


#: How long the Python side keeps each BLS call's response iterator and responses.
#: In the r24.10 python_backend (Triton 2.51) a tensor's numpy array is freed
#: without the GIL when C++ drops the last reference (python_backend PR 390,
#: fixed in 24.12), and the stub's cleanup thread drops its reference to a
#: finished decoupled iterator that way.  That is the suspected cause of the
#: llm stub's segfaults under load (PyType_GenericAlloc on a corrupt heap); it
#: was not reproduced on demand (docs/known-problems.md).  Holding the
#: responses here for a few seconds makes the Python side, with the GIL, the
#: last owner.  Cost: one step reply (B x ceil(V/32) int32, ~100 KB at B = 16
#: with a 49k vocabulary) per step for this long.
RETAIN_S = 5.0


class RemoteMaskProvider:
    """Implements :class:`llm_runtime.mask.MaskProvider` with calls to the ``grammar`` model (channel, else BLS).

    Parameters
    ----------
    pb_utils : module
        ``triton_python_backend_utils`` (only importable inside the stub).
    model_name : str
        The grammar model's name.
    max_rows : int
        Most rows of a step.  Positive: after the first step (whose
        ``BITMASK`` gives the mask width) the masks arrive through a
        :class:`~grammar_service.transport.maskbuf.MaskBuffer` of this many rows
        instead of as a BLS tensor, and the steps go over the grammar
        channel.  0: always as a tensor, over BLS (starts and ends still
        take the channel).
    max_draft : int
        Most draft tokens a row of a step carries (speculative decoding): the
        mask buffer holds ``max_rows * (1 + max_draft)`` rows, the draft
        positions' masks after the step's own.
    """

    def __init__(self, pb_utils: ModuleType, model_name: str = "grammar",
                 clock: Callable[[], float] = time.monotonic, max_rows: int = 0, max_draft: int = 0) -> None:
        self._pb = pb_utils
        self._model = model_name
        self._clock = clock
        self._max_rows = max_rows
        self._max_draft = max_draft
        self._buffer: MaskBuffer | None = None
        self._path: str | None = None  # the grammar channel's socket (asked for over BLS)
        self._path_after = 0.0  # clock time of the next attempt to ask for it
        self._path_lock = threading.Lock()
        self._channel: ChannelClient | None = None  # steps and ends (the decode loop's connection)
        self._starts = threading.local()  # each start thread's connection
        self._clients: list[ChannelClient] = []  # every connection, to close
        self._retained: deque[tuple[float, Any, list[Any]]] = deque()
        self._retain_lock = threading.Lock()

    def _op(self, name: bytes) -> Any:
        # A new tensor per call: Exec saves input tensors to shared memory with
        # the GIL released and no lock, so one tensor shared by the start, step
        # and loop threads could be saved twice at once.
        return self._pb.Tensor("OP", np.array([name], np.object_))

    def _retain(self, iterator: Any, responses: list[Any]) -> None:
        now = self._clock()
        expired: list[tuple[float, Any, list[Any]]] = []
        with self._retain_lock:
            self._retained.append((now + RETAIN_S, iterator, responses))
            while self._retained and self._retained[0][0] <= now:
                expired.append(self._retained.popleft())
        expired.clear()  # freed here, with the GIL, outside the lock

    @property
    def retained(self) -> int:
        """BLS calls whose responses are held (see :data:`RETAIN_S`)."""
        with self._retain_lock:
            return len(self._retained)

    def _call(self, tensors: list[Any], outputs: list[str]) -> Any:
        request = self._pb.InferenceRequest(
            model_name=self._model, inputs=tensors, requested_output_names=outputs
        )
        iterator = request.exec(decoupled=True)
        responses = list(iterator)
        self._retain(iterator, responses)
        reply = None
        for response in responses:
            if response.has_error():
                # Request errors come back as data (ERROR below), so an error
                # response means the grammar model itself failed (its stub died:
                # "Stub process 'grammar_0_0' is not healthy"): the caller may
                # retry once the supervisor has restarted it.
                raise RemoteGrammarError(f"{self._model} failed: {response.error().message()}", UNAVAILABLE)
            if response.output_tensors():
                reply = response
        if reply is None:
            raise RemoteGrammarError(f"{self._model}: no response", UNAVAILABLE)
        error = self._pb.get_output_tensor_by_name(reply, "ERROR")
        if error is not None:
            doc = json.loads(bytes(error.as_numpy().reshape(-1)[0]))
            raise RemoteGrammarError(doc["message"], doc["status"])
        return reply

    def start(self, seq_id: int, constraint: ConstraintRequest) -> str:
        """Compile the constraint (in the grammar model) and create the sequence's matcher; returns its backend."""
        client = self._start_client()
        if client is not None:
            try:
                return client.start(seq_id, constraint.kind, constraint.payload, constraint.options_json,
                                    budget=constraint.budget, validated=constraint.validated,
                                    value_checks=constraint.value_checks)
            except RemoteGrammarError as err:
                if client.closed:  # this start fails (it may have run); the next ones reconnect
                    _log.error("%s; the next calls ask for the channel again", err)
                    self._forget_path()
                raise
        pb = self._pb
        inputs = [
            self._op(b"start"),
            pb.Tensor("SEQUENCE_ID", np.array([seq_id], np.uint64)),
            pb.Tensor("GRAMMAR_TYPE", np.array([constraint.kind.encode()], np.object_)),
            pb.Tensor("GRAMMAR", np.array([constraint.payload.encode("utf-8")], np.object_)),
            pb.Tensor("GRAMMAR_OPTIONS", np.array([constraint.options_json.encode("utf-8")], np.object_)),
            pb.Tensor("MAX_TOKENS", np.array([constraint.budget], np.int32)),
        ]
        if constraint.validated:
            inputs.append(pb.Tensor("VALIDATED", np.array([True])))
        if constraint.value_checks:
            inputs.append(pb.Tensor("VALUE_CHECKS", np.array([True])))
        backend = pb.get_output_tensor_by_name(self._call(inputs, _START_OUTPUTS), "BACKEND")
        if backend is None:
            raise RemoteGrammarError(f"{self._model}: start answered without BACKEND", INTERNAL)
        return bytes(backend.as_numpy().reshape(-1)[0]).decode()

    def _buffer_for(self, rows: int, drafts: np.ndarray | None) -> MaskBuffer | None:
        """The mask buffer where it holds a step of ``rows`` rows and their draft positions (None: BLS tensors)."""
        need = rows * (1 + (0 if drafts is None else int(drafts.shape[1])))
        return self._buffer if self._buffer is not None and need <= self._buffer.array.shape[0] else None

    def send_step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
                  drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> _ChannelPending | None:
        """Send the step over the grammar channel; ``None`` where it goes over BLS (no channel or mask
        buffer yet, or one too small for the drafts): :meth:`step` then makes the whole call.

        Raises
        ------
        RemoteGrammarError
            The channel failed as the step was sent (the next calls ask for it again).
        """
        rows = len(seq_ids)
        buffer = self._buffer_for(rows, drafts)
        if buffer is None:
            return None
        if self._channel is None or self._channel.closed:
            self._channel = self._connect(buffer.name)
        channel = self._channel
        if channel is None:
            return None
        try:
            channel.send_step(seq_ids, tokens, counts, jump_forward, drafts, draft_counts)
        except RemoteGrammarError as err:
            self._channel_failed(channel, err)
            raise
        return _ChannelPending(self, channel, buffer, rows, 0 if drafts is None else int(drafts.shape[1]))

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool = False,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        """Accept each row's new tokens and return the masks of the next tokens (and of the drafts' positions).

        With a mask buffer the returned bitmask is a view of it: valid until
        the next step (the decode loop consumes it before asking again).
        """
        pending = self.send_step(seq_ids, tokens, counts, jump_forward, drafts, draft_counts)
        if pending is not None:
            return pending.result()[0]
        pb = self._pb
        rows = len(seq_ids)
        buffer = self._buffer_for(rows, drafts)
        inputs = [
            self._op(b"step"),
            pb.Tensor("SEQUENCE_ID", np.ascontiguousarray(seq_ids, np.uint64)),
            pb.Tensor("TOKENS", np.ascontiguousarray(tokens, np.int32)),
            pb.Tensor("TOKEN_COUNT", np.ascontiguousarray(counts, np.int32)),
        ]
        outputs = [*STEP_TENSORS, "ERROR"]
        if buffer is not None:
            inputs.append(pb.Tensor("BITMASK_BUFFER", np.array([buffer.name.encode()], np.object_)))
        else:
            outputs.append(BITMASK_TENSOR)
        if jump_forward:
            inputs.append(pb.Tensor("JUMP_FORWARD", np.array([True])))
            outputs += JUMP_TENSORS
        if drafts is not None and draft_counts is not None:
            inputs += [pb.Tensor("DRAFT_TOKENS", np.ascontiguousarray(drafts, np.int32)),
                       pb.Tensor("DRAFT_COUNT", np.ascontiguousarray(draft_counts, np.int32))]
            outputs += DRAFT_TENSORS
            if buffer is None:
                outputs.append(DRAFT_BITMASK_TENSOR)
        reply = self._call(inputs, outputs)

        def output(name: str) -> np.ndarray | None:
            tensor = pb.get_output_tensor_by_name(reply, name)
            return None if tensor is None else tensor.as_numpy()

        draft_bitmask = None
        if buffer is not None:
            bitmask = buffer.array[:rows]
            if drafts is not None:
                draft_bitmask = _draft_rows(buffer, rows, int(drafts.shape[1]))
        else:
            bitmask = pb.get_output_tensor_by_name(reply, BITMASK_TENSOR).as_numpy()
            draft_bitmask = output(DRAFT_BITMASK_TENSOR) if drafts is not None else None
            if self._max_rows and self._buffer is None:
                self._open_buffer(int(bitmask.shape[1]) * 32)
        return answer_from_tensors(output, rows, bitmask, draft_bitmask)

    def _channel_failed(self, channel: ChannelClient, err: RemoteGrammarError) -> None:
        if channel.closed:
            # The channel is gone (the grammar stub died or the two sides
            # disagree): this step's rows fail with the error, as over BLS,
            # and the next calls ask for the channel again.
            _log.error("%s; the next calls ask for the channel again", err)
            self._forget_path()

    def _channel_path(self) -> str | None:
        """The grammar channel's socket, asked for over BLS (None: not available now)."""
        with self._path_lock:
            if self._path is None and self._clock() >= self._path_after:
                try:
                    reply = self._call([self._op(b"channel"), self._pb.Tensor("SEQUENCE_ID", np.zeros(0, np.uint64))],
                                       _CHANNEL_OUTPUTS)
                    path = self._pb.get_output_tensor_by_name(reply, "CHANNEL")
                    if path is None:
                        raise RemoteGrammarError(f"{self._model}: channel answered without CHANNEL", INTERNAL)
                    self._path = bytes(path.as_numpy().reshape(-1)[0]).decode()
                except GrammarError as err:
                    # Calls keep going over BLS (slower, same results); said here, tried again later.
                    _log.error("%s; calls go over BLS (the channel is asked for again in %.0f s)", err,
                               CHANNEL_RETRY_S)
                    self._path_after = self._clock() + CHANNEL_RETRY_S
            return self._path

    def _forget_path(self) -> None:
        with self._path_lock:
            self._path = None
            self._path_after = self._clock() + CHANNEL_RETRY_S

    def _connect(self, mask_buffer: str) -> ChannelClient | None:
        """A new connection to the grammar channel (None, said in the log, where it cannot be opened)."""
        path = self._channel_path()
        if path is None:
            return None
        try:
            client = ChannelClient(path, mask_buffer)
        except RemoteGrammarError as err:
            _log.error("%s; calls go over BLS (the channel is asked for again in %.0f s)", err, CHANNEL_RETRY_S)
            self._forget_path()
            return None
        with self._path_lock:
            self._clients = [c for c in self._clients if not c.closed]
            self._clients.append(client)
        return client

    def _start_client(self) -> ChannelClient | None:
        """This start thread's connection (opened on its first start)."""
        client: ChannelClient | None = getattr(self._starts, "client", None)
        if client is None or client.closed:
            client = self._connect("")
            self._starts.client = client
        return client

    @property
    def channel_open(self) -> bool:
        """Whether steps go over the grammar channel now."""
        return self._channel is not None and not self._channel.closed

    def _open_buffer(self, vocab_bits: int) -> None:
        try:
            self._buffer = MaskBuffer.create(self._max_rows * (1 + self._max_draft), vocab_bits)
        except GrammarError as err:
            # Masks keep coming as BLS tensors (slower, same results); said once, here.
            _log.error("%s; masks stay BLS tensors", err)
            self._max_rows = 0

    def close(self) -> None:
        """Close the grammar channel's connections and remove the mask buffer (the grammar model's
        mapping of it stays valid until it drops it)."""
        with self._path_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()
        self._channel = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def end(self, seq_ids: Sequence[int]) -> None:
        """Free the sequences' matchers (over BLS where the channel is not open: ending is idempotent)."""
        channel = self._channel
        if channel is not None and not channel.closed:
            try:
                channel.end(seq_ids)
                return
            except RemoteGrammarError as err:
                if not channel.closed:
                    raise
                _log.error("%s; the sequences are ended over BLS", err)
                self._forget_path()
        self._call(
            [self._op(b"end"), self._pb.Tensor("SEQUENCE_ID", np.array(list(seq_ids), np.uint64))],
            _CONTROL_OUTPUTS,
        )


class _ChannelPending:
    """A step sent over the grammar channel (:meth:`RemoteMaskProvider.send_step`), answered by :meth:`result`."""

    __slots__ = ("_buffer", "_channel", "_drafts", "_provider", "_rows")

    def __init__(self, provider: RemoteMaskProvider, channel: ChannelClient, buffer: MaskBuffer, rows: int,
                 drafts: int = 0) -> None:
        self._provider = provider
        self._channel = channel
        self._buffer = buffer
        self._rows = rows
        self._drafts = drafts

    def result(self) -> tuple[MaskStep, float]:
        """The grammar model's answer (the bitmask a view of the mask buffer) and the round trip."""
        try:
            answer, round_trip = self._channel.receive_step()
        except RemoteGrammarError as err:
            self._provider._channel_failed(self._channel, err)
            raise
        answer.bitmask = self._buffer.array[: self._rows]
        if self._drafts:
            answer.draft_bitmask = _draft_rows(self._buffer, self._rows, self._drafts)
        return answer, round_trip


def _draft_rows(buffer: MaskBuffer, rows: int, drafts: int) -> np.ndarray:
    """The draft positions' masks in the mask buffer: ``[drafts, rows, W]`` after the step's ``rows`` rows."""
    return buffer.array[rows : rows * (1 + drafts)].reshape(drafts, rows, buffer.array.shape[1])
