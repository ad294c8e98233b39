"""RemoteMaskProvider: starts, steps and ends over the grammar channel, BLS where the channel is not there.

Triton's BLS runs only inside a Python-backend stub (the served tests cover it:
tests/integration); here a small stand-in of ``pb_utils`` hands each BLS
request to a real :class:`GrammarService` the way the ``grammar`` model does,
so the provider's choice between BLS and the channel, its fallback when the
channel goes away and its return to it are checked step by step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from grammar_backend.errors import RemoteGrammarError
from grammar_backend.protocol import answer_tensors
from grammar_service.transport.maskbuf import SHM_DIR
from llm_runtime import remote_mask
from llm_runtime.mask import ConstraintRequest
from llm_runtime.remote_mask import RemoteMaskProvider
from tests.support.poll import HANG_S, wait_for
from tests.unit.conftest import TINY_VOCAB_SIZE
from triton_support.service import GrammarRequest, GrammarService

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this machine")


class _Tensor:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self.name, self.value = name, value

    def as_numpy(self) -> np.ndarray:
        return self.value


class _Response:
    def __init__(self, tensors: list[_Tensor]) -> None:
        self.tensors = tensors

    def has_error(self) -> bool:
        return False

    def output_tensors(self) -> list[_Tensor]:
        return self.tensors


class FakePb:
    """What RemoteMaskProvider calls of ``pb_utils``, answered by a real grammar channel_service; counts the BLS ops."""

    def __init__(self, channel_service: GrammarService) -> None:
        self.service = channel_service
        self.ops: list[str] = []
        provider = self

        class InferenceRequest:
            def __init__(self, model_name: str, inputs: list[_Tensor], requested_output_names: list[str]) -> None:
                self.inputs = {t.name: t.value for t in inputs}
                self.wanted = requested_output_names

            def exec(self, decoupled: bool) -> Iterator[_Response]:
                return iter([provider.serve(self.inputs, self.wanted)])

        self.InferenceRequest = InferenceRequest
        self.Tensor = _Tensor

    def serve(self, inputs: dict[str, np.ndarray], wanted: list[str]) -> _Response:
        def text(name: str) -> bytes:
            return bytes(inputs[name].reshape(-1)[0]) if name in inputs else b""

        op = text("OP").decode()
        self.ops.append(op)
        req = GrammarRequest(
            op=op, seq_ids=inputs["SEQUENCE_ID"], tokens=inputs.get("TOKENS"), counts=inputs.get("TOKEN_COUNT"),
            grammar_type=text("GRAMMAR_TYPE").decode(), grammar=text("GRAMMAR"), grammar_options=text("GRAMMAR_OPTIONS"),
            validated="VALIDATED" in inputs, jump_forward="JUMP_FORWARD" in inputs,
            mask_buffer=text("BITMASK_BUFFER").decode(), budget=int(inputs["MAX_TOKENS"][0]) if "MAX_TOKENS" in inputs
            else 0, value_checks="VALUE_CHECKS" in inputs, drafts=inputs.get("DRAFT_TOKENS"),
            draft_counts=inputs.get("DRAFT_COUNT"))
        reply = self.service.handle(req)
        # As model_repository/grammar/1/model.py's _to_response sends them.
        outs: dict[str, np.ndarray | None] = {
            "ACTIVE_SEQUENCES": np.array([reply.active], np.int32),
            "BACKEND": None if reply.backend is None else np.array([reply.backend.encode()], np.object_),
            "CHANNEL": None if reply.channel is None else np.array([reply.channel.encode()], np.object_)}
        if reply.step is not None:
            outs.update(answer_tensors(reply.step, with_bitmask=not reply.bitmask_in_buffer))
        return _Response([_Tensor(k, v) for k, v in outs.items() if v is not None and k in wanted])

    @staticmethod
    def get_output_tensor_by_name(response: _Response, name: str) -> _Tensor | None:
        return next((t for t in response.tensors if t.name == name), None)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


REGEX = ConstraintRequest("regex", "[ab]+c", '{"on_repeat": "continue"}')


def _step(provider: RemoteMaskProvider, ids: list[int], token: int | None) -> Any:
    rows = len(ids)
    tokens = np.full((rows, 1), token or 0, np.int32)
    counts = np.full(rows, 0 if token is None else 1, np.int32)
    return provider.step(np.array(ids, np.uint64), tokens, counts)


def test_the_channel_carries_starts_steps_and_ends(channel_service: GrammarService) -> None:
    pb = FakePb(channel_service)
    provider = RemoteMaskProvider(pb, max_rows=4)  # type: ignore[arg-type]
    try:
        assert provider.start(1, REGEX) == "xgrammar"
        first = _step(provider, [1], None)  # over BLS: its BITMASK gives the mask buffer's width
        second = _step(provider, [1], ord("a"))
        assert provider.channel_open and second.grammar_s > 0 and np.isnan(first.grammar_s)
        assert first.bitmask.shape == second.bitmask.shape == (1, (TINY_VOCAB_SIZE + 31) // 32)
        provider.end([1])
        assert pb.ops == ["channel", "step"]  # the start, the second step and the end took the channel
    finally:
        provider.close()


def test_draft_masks_are_the_same_over_bls_and_the_channel(channel_service: GrammarService) -> None:
    over_bls = RemoteMaskProvider(FakePb(channel_service))  # type: ignore[arg-type]
    pb = FakePb(channel_service)
    provider = RemoteMaskProvider(pb, max_rows=2, max_draft=2)  # type: ignore[arg-type]
    ids, drafts, counts = np.array([1, 2], np.uint64), np.array([[ord("b"), ord("c")]] * 2, np.int32), np.full(2, 2)
    try:
        for seq_id in (1, 2, 3):
            (over_bls if seq_id == 3 else provider).start(seq_id, REGEX)
        _step(provider, [1, 2], None)  # over BLS: the mask buffer opens, 2 x (1 + 2) rows
        _step(over_bls, [3], None)
        a = np.full((2, 1), ord("a"), np.int32)
        sent = provider.step(ids, a, np.ones(2, np.int32), drafts=drafts, draft_counts=counts)
        want = over_bls.step(np.array([3], np.uint64), a[:1], np.ones(1, np.int32), drafts=drafts[:1],
                             draft_counts=counts[:1])
        assert pb.ops == ["channel", "step"] and provider.channel_open  # the drafted step took the channel
        assert sent.draft_bitmask is not None and want.draft_bitmask is not None
        assert sent.draft_bitmask.shape == (2, 2, (TINY_VOCAB_SIZE + 31) // 32)
        assert np.array_equal(sent.draft_bitmask[:, 0], want.draft_bitmask[:, 0])
        assert np.array_equal(sent.draft_bitmask[:, 1], want.draft_bitmask[:, 0])
        assert sent.draft_valid is not None and want.draft_valid is not None
        assert sent.draft_valid.tolist() == [2, 2] and want.draft_valid.tolist() == [2]
        provider.end([1, 2])
        over_bls.end([3])
    finally:
        provider.close()
        over_bls.close()


def test_calls_go_over_bls_while_the_channel_is_gone_and_come_back(channel_service: GrammarService,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    pb = FakePb(channel_service)
    clock = Clock()
    provider = RemoteMaskProvider(pb, max_rows=4, clock=clock)  # type: ignore[arg-type]
    try:
        provider.start(1, REGEX)
        _step(provider, [1], None)
        _step(provider, [1], ord("a"))
        assert provider.channel_open
        path = channel_service.handle(GrammarRequest("channel", np.zeros(0, np.uint64))).channel
        channel_service.close_channel()  # the grammar side's channel goes away (a restarted stub has a new one)
        with pytest.raises(RemoteGrammarError, match=r"grammar channel") as err:
            _step(provider, [1], ord("b"))
        assert err.value.status == "UNAVAILABLE" and "the next calls ask for the channel again" in caplog.text
        pb.ops.clear()
        channel_service.open_channel()  # a new socket
        assert channel_service.handle(GrammarRequest("channel", np.zeros(0, np.uint64))).channel != path
        _step(provider, [1], ord("b"))  # the failed step never reached the grammar side: fed again, over BLS
        assert pb.ops == ["step"] and not provider.channel_open  # within the retry interval: BLS
        clock.now += remote_mask.CHANNEL_RETRY_S
        _step(provider, [1], ord("b"))
        assert pb.ops == ["step", "channel"] and provider.channel_open  # asked again, and back on the channel
        provider.end([1])
    finally:
        provider.close()


def test_overlap_sends_over_the_channel_from_the_loops_thread(channel_service: GrammarService) -> None:
    """GrammarPhase sends each step over the channel as it launches it and takes the answer at collect:
    no worker thread; the first step (over BLS, to learn the mask width) runs on the worker thread."""
    from llm_runtime.grammar_phase import GrammarPhase

    pb = FakePb(channel_service)
    provider = RemoteMaskProvider(pb, max_rows=4)  # type: ignore[arg-type]
    phase = GrammarPhase(provider, max_rows=4, max_jump_tokens=0, overlap=True)

    @dataclass
    class Row:  # the scheduler's sequence state, as GrammarPhase reads it (PhaseRow)
        last_token: int
        in_engine: bool = True
        seq_id: int = 1
        jump: tuple[int, ...] = ()
        refeed: bool = False
        accepted: tuple[int, ...] = ()
        drafts: tuple[int, ...] = ()

    width = (TINY_VOCAB_SIZE + 31) // 32

    def served_past(count: int) -> Callable[[], bool]:
        return lambda: channel_service.step_latency.count > count

    try:
        provider.start(1, REGEX)
        phase.launch([Row(-1, in_engine=False)])
        phase.collect(width)
        assert pb.ops == ["channel", "step"] and phase.step is not None  # the start's channel, then a BLS step
        for token in (ord("a"), ord("b")):
            served = channel_service.step_latency.count
            before = time.time()  # the clock of a sent step's round trip (call_s)
            phase.launch([Row(token)])
            wait_for(served_past(served), HANG_S, "the step served before collect is called", interval_s=0.001)
            phase.collect(width)
            within = time.time() - before
            assert phase.error is None and phase.step is not None and 0 < phase.call_s <= within
        assert pb.ops == ["channel", "step"] and provider.channel_open  # no more BLS
        assert [t.name for t in threading.enumerate()].count("llm-grammar-step_0") == 1  # the BLS step's, once
        provider.end([1])
    finally:
        phase.close()
        provider.close()
