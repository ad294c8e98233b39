"""The shared-memory mask buffer: the grammar model writes a step's rows where its caller reads them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xgrammar as xgr

from grammar_backend.errors import ConstraintError
from grammar_backend.protocol import bitmask_width
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from grammar_service.transport.maskbuf import SHM_DIR, Attached, MaskBuffer
from tests.unit.conftest import TINY_VOCAB_SIZE, tiny_encode
from triton_support.service import GrammarReply, GrammarRequest, GrammarService

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this machine")


@pytest.fixture()
def buffer() -> Iterator[MaskBuffer]:
    buf = MaskBuffer.create(4, TINY_VOCAB_SIZE)
    yield buf
    buf.close()


@pytest.fixture()
def service(tiny_info: xgr.TokenizerInfo) -> Iterator[GrammarService]:
    svc = GrammarService(GrammarEngine(tiny_info, "fp", GrammarEngineConfig(max_batch=4), encode=tiny_encode))
    yield svc
    svc.engine.close()


def _step(svc: GrammarService, ids: list[int], token: int | None, buffer: str = "") -> GrammarReply:
    rows = len(ids)
    tokens = np.full((rows, 1), token or 0, np.int32)
    counts = np.full(rows, 0 if token is None else 1, np.int32)
    reply = svc.handle(GrammarRequest("step", np.array(ids, np.uint64), tokens, counts, mask_buffer=buffer))
    assert reply.step is not None and reply.bitmask_in_buffer is bool(buffer)
    return reply


def test_steps_through_the_buffer_equal_steps_through_the_reply(service: GrammarService, buffer: MaskBuffer) -> None:
    for sid in (1, 2):
        service.handle(GrammarRequest("start", np.array([sid], np.uint64), grammar_type="regex", grammar=b"[ab]+c"))
    for token in (None, ord("a"), ord("b")):
        plain = _step(service, [1], token)
        shared = _step(service, [2], token, buffer.name)
        assert shared.bitmask_in_buffer and plain.step is not None  # the mask is not sent back: it is in the buffer
        assert np.array_equal(buffer.array[:1], plain.step.bitmask)
    assert buffer.array.shape == (4, bitmask_width(TINY_VOCAB_SIZE))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("../etc/passwd", r"^BITMASK_BUFFER: '\.\./etc/passwd' is not a mask buffer name$"),
        ("cgrammar-mask-1-0123456789abcdef", r"^BITMASK_BUFFER: cannot open cgrammar-mask-1-0123456789abcdef"),
    ],
)
def test_bad_buffers_fail_the_step_before_any_token_is_accepted(service: GrammarService, name: str,
                                                                message: str) -> None:
    service.handle(GrammarRequest("start", np.array([1], np.uint64), grammar_type="regex", grammar=b"ab"))
    _step(service, [1], None)
    with pytest.raises(ConstraintError, match=message):
        _step(service, [1], ord("a"), name)
    assert service.engine.table.get(1).tokens_accepted == 0
    answer = _step(service, [1], ord("a")).step
    assert answer is not None and answer.errors == (None,)


def test_a_step_larger_than_the_buffer_is_refused(service: GrammarService) -> None:
    small = MaskBuffer.create(1, TINY_VOCAB_SIZE)
    try:
        for sid in (1, 2):
            service.handle(GrammarRequest("start", np.array([sid], np.uint64), grammar_type="regex", grammar=b"a"))
        with pytest.raises(ConstraintError, match=r"^BITMASK_BUFFER: cgrammar-mask-\d+-[0-9a-f]{16} holds 1 rows, "
                                                  r"the step has 2$"):
            _step(service, [1, 2], None, small.name)
    finally:
        small.close()


def test_a_file_of_partial_rows_is_refused(tmp_path: Path) -> None:
    name = f"cgrammar-mask-{os.getpid()}-{'0' * 16}"
    (tmp_path / name).write_bytes(b"\0" * 10)
    with pytest.raises(ConstraintError, match=r"is 10 bytes, not whole rows of 40$"):
        Attached(10, directory=tmp_path).rows(name, 1)


def test_buffers_of_dead_creators_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    stale = tmp_path / f"cgrammar-mask-{dead}-{'a' * 16}"
    stale.write_bytes(b"\0" * 40)
    mine = tmp_path / f"cgrammar-mask-{os.getpid()}-{'b' * 16}"
    mine.write_bytes(b"\0" * 40)
    other = tmp_path / "unrelated"
    other.write_bytes(b"x")
    buf = MaskBuffer.create(2, 320, directory=tmp_path)
    assert not stale.exists() and mine.exists() and other.exists()
    assert buf.path.stat().st_size == 2 * 10 * 4
    buf.close()
    assert not buf.path.exists()


def test_attached_keeps_at_most_capacity_buffers_open(tmp_path: Path) -> None:
    bufs = [MaskBuffer.create(1, 32, directory=tmp_path) for _ in range(5)]
    attached = Attached(1, capacity=4, directory=tmp_path)
    for b in bufs:
        attached.rows(b.name, 1)[:] = 7
        assert int(b.array[0, 0]) == 7
    assert len(attached._open) == 3  # the first two went when the third and fourth filled a generation
    for b in bufs:
        b.close()
