"""The grammar channel: starts, steps and ends between processes, the same answers as over BLS.

A real :class:`~triton_support.service.GrammarService` (xgrammar over the tiny
byte vocabulary) serves a real socket; the clients are the ones the ``llm``
model uses.  Steps over the channel must equal steps through
:meth:`GrammarService.handle` (what BLS carries) row for row and bit for bit;
a request-level error keeps its status; a bad message fails that request
only, and the connection stays; a peer that goes away is UNAVAILABLE at once.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from grammar_backend.errors import RemoteGrammarError
from grammar_backend.protocol import MaskStep
from grammar_service.transport.channel import (
    _PREFIX,
    HELLO_MAGIC,
    ChannelBroken,
    ChannelClient,
    decode_reply,
    encode_reply,
)
from grammar_service.transport.maskbuf import SHM_DIR, MaskBuffer
from tests.support.poll import HANG_S
from tests.unit.conftest import TINY_STOP, TINY_VOCAB_SIZE
from triton_support.service import GrammarRequest, GrammarService

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this machine")

REGEX = ("regex", "[ab]+c", "{}")
NUMBER = ("json_schema", ('{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],'
                          '"additionalProperties":false}'), "{}")


@pytest.fixture()
def buffer() -> Iterator[MaskBuffer]:
    buf = MaskBuffer.create(4, TINY_VOCAB_SIZE)
    yield buf
    buf.close()


def _path(channel_service: GrammarService) -> str:
    return channel_service.handle(GrammarRequest("channel", np.zeros(0, np.uint64))).channel or ""


def _start(client: ChannelClient, seq_id: int, constraint: tuple[str, str, str] = REGEX) -> str:
    kind, payload, options = constraint
    return client.start(seq_id, kind, payload, options, budget=0, validated=False, value_checks=False)


def test_steps_over_the_channel_equal_steps_over_bls(channel_service: GrammarService, buffer: MaskBuffer) -> None:
    client = ChannelClient(_path(channel_service), buffer.name)
    assert [_start(client, s) for s in (1, 2)] == ["xgrammar", "xgrammar"]
    channel_service.handle(GrammarRequest("start", np.array([3], np.uint64), grammar_type="regex", grammar=b"[ab]+c"))
    for token in (None, ord("a"), ord("b"), ord("c")):
        counts = np.full(2, 0 if token is None else 1, np.int32)
        tokens = np.full((2, 1), token or 0, np.int32)
        reply = client.step(np.array([1, 2], np.uint64), tokens, counts, jump_forward=True)
        bls = channel_service.handle(GrammarRequest("step", np.array([3], np.uint64), tokens[:1], counts[:1],
                                            jump_forward=True))
        assert bls.step is not None and not bls.bitmask_in_buffer
        want = bls.step
        assert np.array_equal(buffer.array[0], want.bitmask[0]) and np.array_equal(buffer.array[1], want.bitmask[0])
        assert reply.terminated.tolist() == [bool(want.terminated[0])] * 2
        assert reply.closing is not None and want.closing is not None
        assert reply.closing.tolist() == [int(want.closing[0])] * 2
        assert reply.active == 3 and reply.errors == (None, None) and reply.grammar_s > 0
        assert (reply.dropped, reply.hold) == (None, None)
    assert reply.forced_counts is not None and reply.forced_counts.tolist() == [0, 0]  # nothing forced after "abc"
    assert client.end([1, 2, 99]) == 1  # an unknown id is ignored, as over BLS
    channel_service.handle(GrammarRequest("end", np.array([3], np.uint64)))
    client.close()


def test_draft_masks_over_the_channel_equal_those_over_bls(channel_service: GrammarService) -> None:
    """A step with drafts: the draft positions' masks land in the mask buffer after the step's rows, and
    equal BLS's DRAFT_BITMASK; a buffer too small for them fails that step only, by name."""
    buf = MaskBuffer.create(2 * 4, TINY_VOCAB_SIZE)  # 2 rows and 3 drafts each
    small = MaskBuffer.create(4, TINY_VOCAB_SIZE)
    try:
        client = ChannelClient(_path(channel_service), buf.name)
        _start(client, 1)
        _start(client, 2)
        channel_service.handle(GrammarRequest("start", np.array([3], np.uint64), grammar_type="regex",
                                              grammar=b"[ab]+c"))
        ids, bls_id = np.array([1, 2], np.uint64), np.array([3], np.uint64)
        # Row 1 drafts "ab" then "c" and "a" (past the end: its mask is the grammar's end), row 2 "z" (refused).
        drafts = np.array([[ord("a"), ord("b"), ord("c")], [ord("z"), 0, 0]], np.int32)
        counts, tokens = np.zeros(2, np.int32), np.zeros((2, 1), np.int32)
        reply = client.step(ids, tokens, counts, False, drafts, np.array([3, 1], np.int32))
        bls = channel_service.handle(GrammarRequest("step", bls_id, tokens[:1], counts[:1], drafts=drafts[:1],
                                                    draft_counts=np.array([3], np.int32)))
        assert bls.step is not None and bls.step.draft_bitmask is not None and bls.step.draft_valid is not None
        assert reply.draft_valid is not None and reply.draft_valid.tolist() == [3, 0]
        assert bls.step.draft_valid.tolist() == [3]
        in_buffer = buf.array[2:8].reshape(3, 2, -1)
        for j in range(3):
            assert np.array_equal(in_buffer[j, 0], bls.step.draft_bitmask[j, 0])
            assert (in_buffer[j, 1] == -1).all()  # row 2 stopped at its first draft: all ones
        allowed = [{t for t in range(TINY_VOCAB_SIZE) if (int(m[t >> 5]) >> (t & 31)) & 1}
                   for m in bls.step.draft_bitmask[:, 0]]
        assert allowed[0] == allowed[1] and ord("c") in allowed[0]  # after "a", "ab": [ab] or the closing "c"
        assert allowed[2] == {TINY_STOP}  # after "abc", only the end
        # The drafts were not kept: the next step accepts "a" as the row's first token.
        reply = client.step(ids, np.full((2, 1), ord("a"), np.int32), np.ones(2, np.int32), False)
        assert reply.errors == (None, None) and reply.draft_valid is None
        with pytest.raises(RemoteGrammarError, match=r"BITMASK_BUFFER: .* holds 4 rows, the step has 8"):
            ChannelClient(_path(channel_service), small.name).step(ids, tokens[:, :0], counts, False, drafts,
                                                                    np.array([3, 1], np.int32))
        assert client.end([1, 2]) == 1
        channel_service.handle(GrammarRequest("end", bls_id))
        client.close()
    finally:
        buf.close()
        small.close()


def test_a_row_error_is_that_rows_only(channel_service: GrammarService, buffer: MaskBuffer) -> None:
    client = ChannelClient(_path(channel_service), buffer.name)
    _start(client, 1)
    _start(client, 2)
    client.step(np.array([1, 2], np.uint64), np.zeros((2, 1), np.int32), np.zeros(2, np.int32), False)
    reply = client.step(np.array([1, 2], np.uint64), np.array([[ord("a")], [ord("z")]], np.int32),
                        np.ones(2, np.int32), False)
    assert reply.errors == (None, f"sequence 2: token {ord('z')} at position 0 is rejected by the grammar")
    client.end([1, 2])


@pytest.mark.parametrize(
    ("constraint", "status", "match"),
    [
        (("regex", "[a-", "{}"), "INVALID_ARGUMENT", r"^grammar: xgrammar cannot compile this regex: .*Unclosed"),
        (("sql", "x", "{}"), "INVALID_ARGUMENT", r"^grammar_type: unknown kind 'sql'"),
        (("regex", "a", '{"nope": 1}'), "INVALID_ARGUMENT", r"^grammar_options\.nope: unknown option; expected"),
    ],
)
def test_a_start_error_keeps_its_status(channel_service: GrammarService, constraint: tuple[str, str, str], status: str,
                                        match: str) -> None:
    client = ChannelClient(_path(channel_service))
    with pytest.raises(RemoteGrammarError, match=match) as info:
        _start(client, 7, constraint)
    assert info.value.status == status
    assert _start(client, 8) == "xgrammar"  # the connection stays
    with pytest.raises(RemoteGrammarError, match=r"^sequence 8: already started") as dup:
        _start(client, 8)
    assert dup.value.status == "ALREADY_EXISTS"
    client.end([8])


def test_a_connection_without_a_mask_buffer_takes_no_steps(channel_service: GrammarService) -> None:
    client = ChannelClient(_path(channel_service))
    _start(client, 1)
    with pytest.raises(RemoteGrammarError, match=r"named no mask buffer") as info:
        client.step(np.array([1], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32), False)
    assert info.value.status == "INTERNAL" and not client.closed
    client.end([1])


def test_a_slow_start_holds_only_its_connection(channel_service: GrammarService, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start waits for its compile on its own connection; a cached start on another one goes through."""
    path = _path(channel_service)
    fast, slow = ChannelClient(path), ChannelClient(path)
    _start(fast, 1)  # compiled and cached
    gate, holding = threading.Event(), threading.Event()
    original = channel_service.start_async

    def held(req: GrammarRequest, done: object) -> None:
        if int(req.seq_ids[0]) == 2:
            holding.set()
            assert gate.wait(HANG_S)
        original(req, done)  # type: ignore[arg-type]

    monkeypatch.setattr(channel_service, "start_async", held)
    out: list[str] = []
    waiter = threading.Thread(target=lambda: out.append(_start(slow, 2, NUMBER)))
    waiter.start()
    assert holding.wait(HANG_S)  # the slow start is at the grammar model, held there
    assert _start(fast, 3) == "xgrammar"  # answered while the slow one is still held (the gate is closed)
    assert waiter.is_alive() and out == []
    gate.set()
    waiter.join(HANG_S)
    assert out == ["xgrammar"]
    fast.end([1, 2, 3])


def test_malformed_requests_fail_alone(channel_service: GrammarService, buffer: MaskBuffer) -> None:
    path = _path(channel_service)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.connect(path)
    name = buffer.name.encode()
    raw.send(HELLO_MAGIC + struct.pack("<I", len(name)) + name)
    assert raw.recv(2) == b"OK"
    for message, reason in [
        (b"\x01", b"a request of 1 bytes"),
        (struct.pack("<BBHIII", 9, 0, 0, 5, 0, 0), b"unknown op 9"),
        (struct.pack("<BBHIII", 1, 0, 0, 6, 2, 1), b"2 rows of 1 tokens need 48 bytes, got 16"),
        (struct.pack("<BBHIII", 3, 0, 0, 7, 1, 0), b"an end of 1 rows needs 24 bytes, got 16"),
    ]:
        raw.send(message)
        reply = raw.recv(4096)
        assert reply[0] == 1 and reason in reply, reply
    raw.close()
    client = ChannelClient(path, buffer.name)  # the server still serves
    _start(client, 1)
    client.end([1])


def test_a_peer_of_another_kind_is_refused(channel_service: GrammarService, tmp_path: Path) -> None:
    with pytest.raises(RemoteGrammarError, match=r"is not a grammar channel") as bad:
        ChannelClient(str(tmp_path / "elsewhere"))
    assert bad.value.status == "INVALID_ARGUMENT"
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.connect(_path(channel_service))
    raw.send(b"hello?")  # no hello: closed without an answer
    assert raw.recv(2) == b"NO"
    raw.close()
    missing = str(SHM_DIR / f"{_PREFIX}-0-0000000000000000")
    with pytest.raises(RemoteGrammarError, match=r"No such file") as gone:
        ChannelClient(missing)
    assert gone.value.status == "UNAVAILABLE"


def test_the_socket_is_private(channel_service: GrammarService) -> None:
    assert Path(_path(channel_service)).stat().st_mode & 0o777 == 0o600


def test_a_closed_server_is_unavailable_at_once(channel_service: GrammarService, buffer: MaskBuffer) -> None:
    client = ChannelClient(_path(channel_service), buffer.name)
    _start(client, 1)
    channel_service.close_channel()
    with pytest.raises(RemoteGrammarError, match=r"grammar channel .*") as info:
        client.step(np.array([1], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32), False)
    assert info.value.status == "UNAVAILABLE" and client.closed
    assert not Path(client.path).exists()
    channel_service.handle(GrammarRequest("end", np.array([1], np.uint64)))


def test_a_hung_grammar_model_times_the_step_out_and_a_start_waits(
        channel_service: GrammarService, buffer: MaskBuffer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's reply is waited for ``timeout_s`` (the client then gives the channel up: UNAVAILABLE);
    a start is not timed by the channel, however long its compile takes."""
    path = _path(channel_service)
    client = ChannelClient(path, buffer.name, timeout_s=0.3)
    gate = threading.Event()
    original_step, original_start = channel_service.channel_step, channel_service.start_async

    def hung(step: object) -> object:
        assert gate.wait(HANG_S)
        return original_step(step)  # type: ignore[arg-type]

    def slow(req: GrammarRequest, done: object) -> None:
        time.sleep(0.6)  # twice the step timeout
        original_start(req, done)  # type: ignore[arg-type]

    monkeypatch.setattr(channel_service, "start_async", slow)
    assert _start(client, 1) == "xgrammar"
    monkeypatch.setattr(channel_service, "channel_step", hung)
    t0 = time.monotonic()
    with pytest.raises(RemoteGrammarError, match=r"^grammar channel .*: timed out$") as info:
        client.step(np.array([1], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32), False)
    # Not before the step timeout; and given up while the grammar side still hangs (its gate opens only below).
    assert info.value.status == "UNAVAILABLE" and client.closed and time.monotonic() - t0 >= 0.3
    gate.set()
    channel_service.handle(GrammarRequest("end", np.array([1], np.uint64)))


def test_steps_and_ends_of_two_callers_never_overlap(channel_service: GrammarService) -> None:
    """Two llm instances step at once over their own connections: the engine's buffers stay whole
    (the channel_service's op lock), and each caller reads its own rows."""
    bufs = [MaskBuffer.create(4, TINY_VOCAB_SIZE) for _ in range(2)]
    try:
        path = _path(channel_service)
        clients = [ChannelClient(path, b.name) for b in bufs]
        seqs = [[1, 2], [3, 4]]
        endless = ("regex", "[ab]+c", '{"on_repeat": "continue"}')  # "aaaa..." is not closed as a runaway
        for c, ids in zip(clients, seqs, strict=True):
            for s in ids:
                _start(c, s, endless)
        expected = channel_service.handle(GrammarRequest("stats", np.zeros(0, np.uint64))).active
        assert expected == 4
        errors: list[BaseException] = []

        def run(c: ChannelClient, ids: list[int], buf: MaskBuffer) -> None:
            try:
                arr = np.array(ids, np.uint64)
                c.step(arr, np.zeros((2, 1), np.int32), np.zeros(2, np.int32), False)
                for _ in range(200):
                    c.step(arr, np.full((2, 1), ord("a"), np.int32), np.ones(2, np.int32), False)
                    words = buf.array[:2]
                    allowed = {t for t in range(TINY_VOCAB_SIZE) if words[0, t // 32] & np.int32(
                        np.uint32(1 << (t % 32)).view(np.int32))}
                    # After "a" of "[ab]+c": a, b, c, and the vocabulary's "ab" and "abc".
                    assert allowed == {ord("a"), ord("b"), ord("c"), 262, 263}, allowed
            except BaseException as err:  # noqa: BLE001 -- re-raised below
                errors.append(err)

        threads = [threading.Thread(target=run, args=(c, ids, b)) for c, ids, b in zip(clients, seqs, bufs,
                                                                                           strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        for c, ids in zip(clients, seqs, strict=True):
            c.end(ids)
    finally:
        for b in bufs:
            b.close()


def test_a_step_sent_now_is_received_later(channel_service: GrammarService, buffer: MaskBuffer) -> None:
    """send_step returns at once; the grammar model answers while the caller does other work (its forward);
    the round trip counts until the reply arrived (the kernel's stamp), not until receive_step was called."""
    client = ChannelClient(_path(channel_service), buffer.name)
    _start(client, 1)
    ids, tokens, counts = np.array([1], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32)
    # The round trip is on time.time()'s clock, the kernel's stamp's.
    before_send = time.time()
    client.send_step(ids, tokens, counts, False)
    after_send = time.time()
    # The reply is in the client's socket (answered with no receive_step yet).
    assert select.select([client._sock], [], [], HANG_S)[0]
    arrived_by = time.time()
    time.sleep(after_send - before_send + 0.05)  # so the call below comes later than the arrival by more than that
    called = time.time()
    reply, round_trip = client.receive_step()
    assert reply.terminated.tolist() == [False] and reply.active == 1
    assert 0 < round_trip <= arrived_by - before_send  # until the reply arrived ...
    assert round_trip < called - after_send  # ... not until receive_step was called
    client.end([1])


@pytest.mark.parametrize(
    ("calls", "match"),
    [
        (("send", "send"), r"a step is already in flight"),
        (("receive",), r"no step is in flight"),
        (("send", "end"), r"a step is in flight"),
    ],
)
def test_one_step_in_flight_at_a_time(channel_service: GrammarService, buffer: MaskBuffer, calls: tuple[str, ...],
                                      match: str) -> None:
    client = ChannelClient(_path(channel_service), buffer.name)
    _start(client, 1)
    ids, tokens, counts = np.array([1], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32)
    ops = {"send": lambda: client.send_step(ids, tokens, counts, False), "receive": client.receive_step,
           "end": lambda: client.end([1])}
    for op in calls[:-1]:
        ops[op]()
    with pytest.raises(RemoteGrammarError, match=match) as info:
        ops[calls[-1]]()
    assert info.value.status == "INTERNAL" and not client.closed
    if calls[0] == "send":
        assert client.receive_step()[0].active == 1  # the step in flight is still answered
    client.end([1])


def test_connection_threads_never_preempt_the_caller(channel_service: GrammarService, buffer: MaskBuffer) -> None:
    """Each connection is served under SCHED_BATCH: a step's request does not preempt the decode loop that sent it."""
    client = ChannelClient(_path(channel_service), buffer.name)
    _start(client, 1)  # the connection is served by now
    served = [t for t in threading.enumerate() if t.name == "grammar-channel" and t.native_id is not None]
    assert served and {os.sched_getscheduler(t.native_id or 0) for t in served} == {os.SCHED_BATCH}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own policy is untouched
    client.end([1])


_FULL_REPLY = MaskStep(
    bitmask=np.zeros((0, 0), np.int32), active=3, terminated=np.array([False, True]),
    closing=np.array([0, 2], np.int8), dropped=np.array([0, 1], np.int32), hold=np.array([2, 0], np.int32),
    errors=(None, "bad row"), forced_tokens=np.array([[5, 6, 7], [8, 0, 0]], np.int32),
    forced_counts=np.array([3, 1], np.int32), forced_safe=np.array([1, 0], np.int32), grammar_s=0.25)


@pytest.mark.parametrize("cut", [1, 4, 40])
def test_a_reply_cut_short_is_a_broken_channel(cut: int) -> None:
    """2 rows: terminated and closing 2 bytes each, dropped, hold and forced_safe 8 each, forced counts 8 and
    tokens 2 x 3 x 4: 60 bytes of arrays."""
    data = encode_reply(9, replace(_FULL_REPLY, errors=(None, None)))
    with pytest.raises(ChannelBroken, match=rf"^grammar channel: a reply of 2 rows needs 60 bytes of arrays, got {60 - cut}$"):
        decode_reply(memoryview(data[:-cut]), 9)
