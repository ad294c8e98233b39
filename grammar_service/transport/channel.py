"""The grammar channel: the ``llm`` model's calls to the ``grammar`` model without Triton's request path.

Every decode step the ``llm`` model asks the ``grammar`` model for the masks
of its constrained rows.  Over Triton BLS that call crosses the llm stub's
IPC queue, tritonserver's request and response path and the grammar stub's
queue twice each: with the tiny stand-in at 16 rows a BLS step took p50
2.5 ms against 0.43 ms over this channel (``make bench-path``;
``bench/grammar_step_bench.py --rows 16`` compares ``bls tensor`` and
``channel`` over Qwen3's vocabulary), and its CPU in the two stubs and
tritonserver cost more than the forward it was meant to hide behind.  A
``start`` over BLS added about as much to a request's time to first token
(docs/benchmarks.md, the serving path's first round).

The channel is a Unix ``SOCK_SEQPACKET`` socket (one message per request and
per reply, message boundaries kept by the kernel) that the ``grammar`` model
listens on.  Each connection is served by a thread of its own, one request
at a time: the ``llm`` model steps (and ends sequences) on one connection,
and each of its start threads starts on one of its own, so a slow compile
holds only the thread that waits for it, as a BLS start would.  The masks
still go through the caller's shared-memory mask buffer
(:mod:`grammar_service.transport.maskbuf`), named when the connection opens; a message
holds only the row ids, the new tokens and the small per-row answers.
``rollback`` and ``stats`` stay on BLS, and the ``grammar`` model keeps owning
every matcher: the channel moves the same requests in and the same answers
out as BLS does (:class:`ChannelHandler` is the grammar service).

A socket rather than a futex on shared memory: a dead peer is an immediate
error on the other side (EOF, ``ECONNRESET``), not a wait forever, and the
kernel wakes the one thread that waits; an empty step's round trip is tens
of microseconds (docs/benchmarks.md).

Security: the socket lives in :data:`SOCKET_DIR` with mode ``0600``, and the
server accepts only peers of its own user id (``SO_PEERCRED``).

Wire format (little-endian; ``B`` rows, ``K`` tokens per row, ``F`` forced
tokens per row)::

    hello   HELLO_MAGIC u32 name_len, name (the caller's mask buffer; empty: no steps)
    request u8 op u8 flags u16 D u32 seq u32 B u32 K, then by op:
            step  (1; flags 1 = jump forward, 2 = drafts)  seq_ids u64[B], counts i32[B], tokens i32[B*K],
                  with drafts: draft counts i32[B], draft tokens i32[B*D] (D: the u16; masks of the
                  positions after them go to the mask buffer's rows B..B+D*B, [D, B, W])
            start (2; flags 1 = validated, 2 = value checks; B = 1, K = 0)
                  seq_id u64, budget i32, u32 lengths of kind, payload, options, their UTF-8 bytes
            end   (3; K = 0)                   seq_ids u64[B]
    reply   u8 status (0 ok, 1 error) u8 0 u16 flags u32 seq u32 B u32 F | D << 16 i32 active (-1: not
            reported) f32 seconds (the step's time in the grammar model; NaN: not measured), then by op:
            step  each field of grammar_backend.protocol.STEP_FIELDS, in order, where
                  flags & (1 << its index): B values of its dtype (B*F where it is wide, B*D
                  where it is a wide draft field; bool as u8), the row errors a JSON list of B
                  strings ("": none)
            start the backend's name (UTF-8)
            end   nothing
    error   the reply header with status 1, then JSON {"status": name, "message": text}
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import numpy as np

from grammar_backend.errors import INTERNAL, INVALID_ARGUMENT, UNAVAILABLE, GrammarError, RemoteGrammarError, status_of
from grammar_backend.protocol import STEP_FIELDS, Field, MaskStep, Sent

__all__ = [
    "NO_MASK", "SOCKET_DIR", "ChannelBroken", "ChannelClient", "ChannelHandler", "ChannelServer",
    "ChannelStart", "ChannelStep",
]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

SOCKET_DIR: Final = Path("/dev/shm")
_PREFIX: Final = "cgrammar-channel"
HELLO_MAGIC: Final = b"CGC2"
OP_STEP, OP_START, OP_END = 1, 2, 3
_OP_NAMES: Final = {OP_STEP: "step", OP_START: "start", OP_END: "end"}
_FLAG_JUMP: Final = 1
_FLAG_DRAFTS: Final = 2
_FLAG_VALIDATED: Final = 1
_FLAG_VALUE_CHECKS: Final = 2
#: Each field of a step's answer: its flag bit, the field and its bytes per value.
_FIELD_BITS: Final = tuple((1 << i, f, np.dtype(f.dtype).itemsize) for i, f in enumerate(STEP_FIELDS))
_REQUEST = struct.Struct("<BBHIII")
_REPLY = struct.Struct("<BxHIIIif")
_START = struct.Struct("<QiIII")
#: Linux's SO_TIMESTAMPNS (the socket module does not name it): each message received carries
#: its arrival time as a ``struct timespec`` (CLOCK_REALTIME, ``time.time()``'s clock).
_SO_TIMESTAMPNS: Final = 35
_TIMESPEC = struct.Struct("@qq")
_STAMP_SPACE: Final = socket.CMSG_SPACE(_TIMESPEC.size)
#: Largest message either side takes: 4 MiB holds a step of 4,096 rows of 64
#: tokens, or a start with the largest constraint (contract.MAX_CONSTRAINT_BYTES);
#: the socket buffers are sized for it.
MAX_MESSAGE: Final = 4 * 1024 * 1024
#: How long a caller waits for a step's or an end's reply before it gives the
#: channel up (they take milliseconds; this only catches a grammar model that
#: hangs).  A start waits for its compile, which the grammar model bounds itself.
DEFAULT_TIMEOUT_S: Final = 60.0
#: The bitmask of a decoded step answer: none (the mask is in the caller's buffer; :func:`decode_reply`).
NO_MASK: Final = np.zeros((0, 0), np.int32)


@dataclass(frozen=True)
class ChannelStep:
    """A step as it crosses the channel (the fields of a ``step`` :class:`~triton_support.service.GrammarRequest`)."""

    seq_ids: np.ndarray
    tokens: np.ndarray
    counts: np.ndarray
    jump_forward: bool
    mask_buffer: str
    drafts: np.ndarray | None = None  # int32 [B, D]
    draft_counts: np.ndarray | None = None  # int32 [B]


@dataclass(frozen=True)
class ChannelStart:
    """A start as it crosses the channel (the fields of a ``start`` :class:`~triton_support.service.GrammarRequest`)."""

    seq_id: int
    kind: str
    payload: bytes
    options: bytes
    budget: int
    validated: bool
    value_checks: bool


class ChannelHandler(Protocol):
    """What serves the channel's requests (the grammar service); each raises :class:`GrammarError` for a
    request-level error, which the caller gets with its status."""

    def channel_step(self, step: ChannelStep) -> MaskStep: ...
    def channel_start(self, start: ChannelStart) -> str: ...
    def channel_end(self, seq_ids: Sequence[int]) -> int: ...


class ChannelBroken(RemoteGrammarError):
    """A malformed reply: the two sides disagree on the wire format, so the channel is dropped."""

    def __init__(self, message: str) -> None:
        super().__init__(message, INTERNAL)


def _socket_options(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MAX_MESSAGE)


# ------------------------------------------------------------------------- wire format
def encode_reply(seq: int, answer: MaskStep) -> bytes:
    """The reply message of step request ``seq``: the answer's fields but its bitmask (the caller's buffer
    holds it).

    Raises
    ------
    GrammarError
        The answer lacks a field the protocol always sends.
    """
    rows = len(answer.terminated)
    flags = 0
    forced_width = draft_width = 0
    parts = []
    for bit, f, _ in _FIELD_BITS:
        value = getattr(answer, f.name)
        if f.sent is Sent.ERRORS:
            if any(e is not None for e in value):
                flags |= bit
                parts.append(json.dumps([e or "" for e in value]).encode())
        elif value is not None:
            flags |= bit
            if f.wide and f.sent is Sent.DRAFTS:
                draft_width = int(value.shape[1])
            elif f.wide:
                forced_width = int(value.shape[1])
            parts.append(np.ascontiguousarray(value, f.dtype).tobytes())
        elif f.sent is Sent.ALWAYS:
            raise GrammarError(f"grammar channel: a step answer without {f.name}")
    # One u32 of the header holds both widths: a forced run and a draft count are each at most u16.
    widths = forced_width | draft_width << 16
    return _REPLY.pack(0, flags, seq, rows, widths, answer.active, answer.grammar_s) + b"".join(parts)


def encode_error(seq: int, err: BaseException) -> bytes:
    """The error reply of request ``seq``: ``err``'s status and message."""
    doc = json.dumps({"status": status_of(err), "message": str(err)}).encode()
    return _REPLY.pack(1, 0, seq, 0, 0, 0, 0.0) + doc


def _reply_body(data: memoryview, seq: int) -> tuple[int, int, int, int, float, memoryview]:
    """The reply header's fields and the body; raises the remote error of an error reply."""
    if len(data) < _REPLY.size:
        raise ChannelBroken(f"grammar channel: a reply of {len(data)} bytes")
    status, flags, got, rows, fw, active, seconds = _REPLY.unpack_from(data)
    if got != seq:
        raise ChannelBroken(f"grammar channel: reply {got} to request {seq}")
    body = data[_REPLY.size:]
    if status:
        doc = json.loads(bytes(body))
        raise RemoteGrammarError(str(doc["message"]), str(doc["status"]))
    return flags, rows, fw, active, seconds, body


def decode_reply(data: memoryview, seq: int) -> MaskStep:
    """A step's reply message as the answer, its arrays views of ``data`` (valid until its buffer is reused).

    Its bitmask is :data:`NO_MASK`: the mask is in the caller's buffer, whose rows the caller sets.

    Raises
    ------
    RemoteGrammarError
        The reply is the grammar model's error (its status kept).
    ChannelBroken
        The reply is malformed.
    """
    flags, rows, widths, active, seconds, body = _reply_body(data, seq)
    fw, dw = widths & 0xFFFF, widths >> 16
    # The arrays' sizes, known from the header, are checked at once; each
    # array is then one frombuffer (this runs on the decode loop every step).
    size = sum(rows * _width(f, fw, dw) * itemsize
               for bit, f, itemsize in _FIELD_BITS if flags & bit and f.sent is not Sent.ERRORS)
    if len(body) < size:
        raise ChannelBroken(f"grammar channel: a reply of {rows} rows needs {size} bytes of arrays, got {len(body)}")
    fields: dict[str, Any] = {}
    at = 0
    for bit, f, itemsize in _FIELD_BITS:
        if not flags & bit:
            if f.sent is Sent.ALWAYS:
                raise ChannelBroken(f"grammar channel: a step reply without {f.name}")
            fields[f.name] = (None,) * rows if f.sent is Sent.ERRORS else None
        elif f.sent is Sent.ERRORS:
            errors = json.loads(bytes(body[at:]))
            if len(errors) != rows:
                raise ChannelBroken(f"grammar channel: {len(errors)} row errors for {rows} rows")
            fields[f.name] = tuple(str(e) or None for e in errors)
        else:
            w = _width(f, fw, dw)
            count = rows * w
            value = np.frombuffer(body, f.dtype, count, at)
            fields[f.name] = value.reshape(rows, w) if f.wide else value
            at += count * itemsize
    return MaskStep(bitmask=NO_MASK, grammar_s=seconds, active=active, **fields)


def _width(f: Field, forced: int, drafts: int) -> int:
    """Elements per row of field ``f`` in a reply whose header gave these widths."""
    if not f.wide:
        return 1
    return drafts if f.sent is Sent.DRAFTS else forced


def _decode_start(view: memoryview, at: int, n: int, flags: int) -> ChannelStart:
    if n < at + _START.size:
        raise GrammarError(f"grammar channel: a start of {n} bytes")
    seq_id, budget, nk, npay, nopt = _START.unpack_from(view, at)
    at += _START.size
    if n != at + nk + npay + nopt:
        raise GrammarError(f"grammar channel: a start of {n} bytes holds {nk} + {npay} + {nopt} bytes of text")
    kind = bytes(view[at : at + nk]).decode("utf-8", "replace")
    payload = bytes(view[at + nk : at + nk + npay])
    options = bytes(view[at + nk + npay : n])
    return ChannelStart(seq_id, kind, payload, options, budget, bool(flags & _FLAG_VALIDATED),
                        bool(flags & _FLAG_VALUE_CHECKS))


# ------------------------------------------------------------------------- server
class ChannelServer:
    """The ``grammar`` model's side: listens, and serves each connection on a thread of its own.

    Parameters
    ----------
    handler : ChannelHandler
        Serves the requests (the grammar service).
    directory : Path
        Where the socket is created.
    on_served : callable, optional
        Called with the op's name after every served request (metrics), on
        the connection's thread.
    """

    def __init__(self, handler: ChannelHandler, directory: Path = SOCKET_DIR,
                 on_served: Callable[[str], None] | None = None) -> None:
        self._handler = handler
        self._on_served = on_served
        self.path = directory / f"{_PREFIX}-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)  # the socket file is created 0600: this user only
        try:
            self._sock.bind(str(self.path))
        except OSError as err:
            self._sock.close()
            raise GrammarError(f"grammar channel: cannot listen on {self.path}: {err}") from err
        finally:
            os.umask(old)
        self._sock.listen(128)
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._policy_refused = False
        self._thread = threading.Thread(target=self._accept, name="grammar-channel-accept", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._conns)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                _, uid, _ = struct.unpack("3i", creds)
                if uid != os.getuid():
                    _log.error("grammar channel: refused a peer of uid %d", uid)
                    conn.close()
                    continue
                _socket_options(conn)
            except OSError as err:  # that peer is gone already; the next ones are still accepted
                _log.error("grammar channel: a connection failed as it opened: %s", err)
                conn.close()
                continue
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve_connection, args=(conn,), name="grammar-channel",
                             daemon=True).start()

    def _never_preempt(self) -> None:
        """Run the calling connection thread under ``SCHED_BATCH``: its wakeups never preempt a running thread.

        Each step's request wakes the connection's thread.  Under the default
        policy the kernel ran the woken thread at once on the sender's core
        when the other core was busy: the ``llm`` model's decode loop, which
        sends a step and then runs its forward, stood still for the whole
        grammar step (the send p50 0.50 ms against 0.04 ms at 16 rows of the
        tiny stand-in on 2 shared cores, ``make bench-path``; docs/benchmarks.md,
        the serving path's second round).  Under ``SCHED_BATCH`` the thread runs on
        a free core, or once the forward ends (the loop then waits for the
        reply), not in the middle of it; its share of the CPU is unchanged.
        No privilege is needed; where a sandbox refuses it, that is said once
        and the channel serves under the default policy.
        """
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError as err:
            with self._lock:
                said, self._policy_refused = self._policy_refused, True
            if not said:
                _log.warning("grammar channel: SCHED_BATCH refused (%s): its threads may preempt the decode loop", err)

    def _serve_connection(self, conn: socket.socket) -> None:
        buf = bytearray(MAX_MESSAGE)
        view = memoryview(buf)
        self._never_preempt()
        try:
            n = conn.recv_into(buf)
            name = self._hello(view[:n])
            conn.send(b"NO" if name is None else b"OK")
            if name is None:
                return
            while True:
                n = conn.recv_into(buf, MAX_MESSAGE, socket.MSG_TRUNC)
                if n == 0:
                    return  # the caller closed the channel
                reply, op = self._answer(view, n, name)
                conn.send(reply)
                if self._on_served is not None and op:
                    self._on_served(op)
        except OSError as err:
            if not self._closed.is_set():
                _log.error("grammar channel: connection lost: %s", err)
        finally:
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            conn.close()

    @staticmethod
    def _hello(data: memoryview) -> str | None:
        if len(data) < 8 or bytes(data[:4]) != HELLO_MAGIC:
            _log.error("grammar channel: a connection without a hello was closed")
            return None
        (size,) = struct.unpack_from("<I", data, 4)
        return bytes(data[8 : 8 + size]).decode("utf-8", "replace")

    def _answer(self, view: memoryview, n: int, mask_buffer: str) -> tuple[bytes, str]:
        """The reply to the request in ``view[:n]`` and its op's name ("" when malformed)."""
        seq = 0
        name = ""
        try:
            if n > MAX_MESSAGE:
                raise GrammarError(f"grammar channel: a request of {n} bytes exceeds {MAX_MESSAGE}")
            if n < _REQUEST.size:
                raise GrammarError(f"grammar channel: a request of {n} bytes")
            op, flags, draft_width, seq, rows, width = _REQUEST.unpack_from(view)
            if op not in _OP_NAMES:
                raise GrammarError(f"grammar channel: unknown op {op}")
            name = _OP_NAMES[op]
            at = _REQUEST.size
            if op == OP_START:
                backend = self._handler.channel_start(_decode_start(view, at, n, flags))
                return _REPLY.pack(0, 0, seq, 1, 0, 0, 0.0) + backend.encode(), name
            if op == OP_END:
                if n != at + 8 * rows:
                    raise GrammarError(f"grammar channel: an end of {rows} rows needs {at + 8 * rows} bytes, got {n}")
                active = self._handler.channel_end([int(s) for s in np.frombuffer(view, np.uint64, rows, at)])
                return _REPLY.pack(0, 0, seq, 0, 0, active, 0.0), name
            drafting = bool(flags & _FLAG_DRAFTS)
            need = at + rows * (8 + 4 + 4 * width) + (rows * (4 + 4 * draft_width) if drafting else 0)
            if n != need:
                raise GrammarError(f"grammar channel: {rows} rows of {width} tokens need {need} bytes, got {n}")
            if not mask_buffer:
                raise GrammarError("grammar channel: this connection named no mask buffer, so it takes no steps")
            seq_ids = np.frombuffer(view, np.uint64, rows, at)
            counts = np.frombuffer(view, np.int32, rows, at + 8 * rows)
            tokens = np.frombuffer(view, np.int32, rows * width, at + 12 * rows).reshape(rows, width)
            drafts = draft_counts = None
            if drafting:
                at += rows * (12 + 4 * width)
                draft_counts = np.frombuffer(view, np.int32, rows, at)
                drafts = np.frombuffer(view, np.int32, rows * draft_width, at + 4 * rows).reshape(rows, draft_width)
            step = ChannelStep(seq_ids, tokens, counts, bool(flags & _FLAG_JUMP), mask_buffer, drafts, draft_counts)
            return encode_reply(seq, self._handler.channel_step(step)), name
        except GrammarError as err:
            return encode_error(seq, err), name
        except Exception as err:  # noqa: BLE001 -- a bug: the caller's request fails with INTERNAL, the channel stays
            _log.exception("grammar channel: a %s failed", name or "request")
            failure = GrammarError(f"grammar: internal error in {name or 'a channel request'}: {err!r}")
            return encode_error(seq, failure), name

    def close(self) -> None:
        """Stop accepting, close every connection and remove the socket file."""
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.path.unlink(missing_ok=True)


# ------------------------------------------------------------------------- client
class ChannelClient:
    """The ``llm`` model's side of one connection: one request at a time.

    Parameters
    ----------
    path : str
        The server's socket (the ``grammar`` model's ``CHANNEL`` output).
    mask_buffer : str
        The caller's mask buffer name (the grammar side writes every step's
        rows there); ``""`` for a connection that only starts and ends.
    timeout_s : float
        Longest wait for a step's or an end's reply.

    Raises
    ------
    RemoteGrammarError
        ``UNAVAILABLE``: the channel cannot be opened (no such socket, refused).
    """

    def __init__(self, path: str, mask_buffer: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not path.startswith(f"{SOCKET_DIR}/{_PREFIX}-"):
            raise RemoteGrammarError(f"grammar channel: {path!r} is not a grammar channel", INVALID_ARGUMENT)
        self.path = path
        self._timeout = timeout_s
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout_s)  # for the connect and the hello; blocking afterwards (_send)
        self._wait_s: float | None = timeout_s  # how long the next receive may wait (set by each send)
        self._seq = 0
        self._in_flight: int | None = None  # the request number of a step sent and not yet received
        self._sent_at = 0.0
        self._buf = bytearray(MAX_MESSAGE)
        self._view = memoryview(self._buf)
        self._lock = threading.Lock()
        try:
            _socket_options(self._sock)
            # Each reply carries its arrival time, for the round trip of a step received late.
            self._sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            self._sock.connect(path)
            name = mask_buffer.encode()
            self._sock.send(HELLO_MAGIC + struct.pack("<I", len(name)) + name)
            if self._sock.recv(2) != b"OK":
                raise OSError("the grammar model refused the hello")
            self._sock.settimeout(None)
        except OSError as err:
            self._sock.close()
            raise RemoteGrammarError(f"grammar channel {path}: {err}", UNAVAILABLE) from err

    def step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool,
             drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> MaskStep:
        """One step, sent and waited for; the returned arrays are views valid until the next call, and its
        bitmask :data:`NO_MASK` (the masks are in the mask buffer, the drafts' after the step's rows).

        Raises
        ------
        RemoteGrammarError
            The grammar model's request-level error (its status kept), or
            ``UNAVAILABLE`` when the channel failed (the client is then closed).
        """
        self.send_step(seq_ids, tokens, counts, jump_forward, drafts, draft_counts)
        return self.receive_step()[0]

    def send_step(self, seq_ids: np.ndarray, tokens: np.ndarray, counts: np.ndarray, jump_forward: bool,
                  drafts: np.ndarray | None = None, draft_counts: np.ndarray | None = None) -> None:
        """Send a step without waiting for its reply: :meth:`receive_step` takes it.

        The decode loop sends before its forward and receives after it, so
        the grammar model works while the forward runs and no thread of the
        loop's process wakes for it.  A worker thread that made the call
        took the GIL from the forward (which releases it at every torch op)
        when it woke, sent and read the answer: with it the tiny stand-in's
        constrained forward at 16 rows ran 1.41 ms against 0.82 ms free
        (``make bench-path``; docs/benchmarks.md, the serving path's second
        round).  The arrays are copied into the message here.

        Raises
        ------
        RemoteGrammarError
            As :meth:`step`; ``INTERNAL`` when a step is already in flight.
        """
        rows = len(seq_ids)
        width = int(tokens.shape[1]) if tokens.ndim == 2 else 0
        flags = _FLAG_JUMP if jump_forward else 0
        parts = [np.ascontiguousarray(seq_ids, np.uint64).tobytes(), np.ascontiguousarray(counts, np.int32).tobytes(),
                 np.ascontiguousarray(tokens, np.int32).tobytes()]
        draft_width = 0
        if drafts is not None and draft_counts is not None:
            flags |= _FLAG_DRAFTS
            draft_width = int(drafts.shape[1])
            parts += [np.ascontiguousarray(draft_counts, np.int32).tobytes(),
                      np.ascontiguousarray(drafts, np.int32).tobytes()]
        with self._lock:
            if self._in_flight is not None:
                raise RemoteGrammarError(f"grammar channel {self.path}: a step is already in flight", INTERNAL)
            seq = self._next()
            self._send(b"".join((_REQUEST.pack(OP_STEP, flags, draft_width, seq, rows, width), *parts)),
                       self._timeout)
            self._in_flight = seq

    def receive_step(self) -> tuple[MaskStep, float]:
        """The reply of the step :meth:`send_step` sent, and its round trip in seconds.

        The round trip runs from the send to the reply's arrival (the
        kernel's receive timestamp), not to this call: a reply that waited
        while the caller's forward ran counts only until it came.  The
        returned arrays are views valid until the next call.

        Raises
        ------
        RemoteGrammarError
            As :meth:`step`; ``INTERNAL`` when no step is in flight.
        """
        with self._lock:
            seq, self._in_flight = self._in_flight, None
            if seq is None:
                raise RemoteGrammarError(f"grammar channel {self.path}: no step is in flight", INTERNAL)
            data, arrived = self._receive()
            try:
                return decode_reply(data, seq), arrived - self._sent_at
            except ChannelBroken:
                self.close()
                raise

    def start(self, seq_id: int, kind: str, payload: str, options: str, *, budget: int, validated: bool,
              value_checks: bool) -> str:
        """Start a sequence (blocking: the grammar model may compile); returns its backend.

        Raises
        ------
        RemoteGrammarError
            As :meth:`step` (a bad constraint keeps its ``INVALID_ARGUMENT``).
        """
        texts = [kind.encode(), payload.encode("utf-8"), options.encode("utf-8")]
        flags = (_FLAG_VALIDATED if validated else 0) | (_FLAG_VALUE_CHECKS if value_checks else 0)
        with self._lock:
            seq = self._next()
            # No timeout: the grammar model bounds the compile (its compile_timeout_s).
            data = self._exchange(b"".join((_REQUEST.pack(OP_START, flags, 0, seq, 1, 0),
                                            _START.pack(seq_id, budget, *(len(t) for t in texts)), *texts)), None)
            try:
                *_, body = _reply_body(data, seq)
            except ChannelBroken:
                self.close()
                raise
            return bytes(body).decode("utf-8", "replace")

    def end(self, seq_ids: Sequence[int]) -> int:
        """Free the sequences' matchers; returns the grammar model's active sequences after.

        Raises
        ------
        RemoteGrammarError
            As :meth:`step`.
        """
        ids = np.asarray(seq_ids, np.uint64)
        with self._lock:
            seq = self._next()
            data = self._exchange(_REQUEST.pack(OP_END, 0, 0, seq, len(ids), 0) + ids.tobytes(), self._timeout)
            try:
                return _reply_body(data, seq)[3]
            except ChannelBroken:
                self.close()
                raise

    def _next(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    def _exchange(self, message: bytes, timeout_s: float | None) -> memoryview:
        """Send one request and take its reply (a view of this client's buffer); under ``_lock``."""
        if self._in_flight is not None:
            raise RemoteGrammarError(f"grammar channel {self.path}: a step is in flight", INTERNAL)
        self._send(message, timeout_s)
        return self._receive()[0]

    def _send(self, message: bytes, timeout_s: float | None) -> None:
        """Send a request; its reply is then waited for at most ``timeout_s`` (None: as long as it takes).

        The socket is blocking, and each call is made with ``MSG_DONTWAIT``:
        a socket timeout would make Python poll before every send and every
        receive, a second system call (and a second release of the GIL, which
        the llm stub's response thread may then hold) on the decode loop's
        path twice a step; here a poll runs only where the call would block.
        """
        self._wait_s = timeout_s
        try:
            self._sent_at = time.time()
            try:
                self._sock.send(message, socket.MSG_DONTWAIT)
            except BlockingIOError:  # no room in the socket's buffer (one request in flight: never seen)
                self._until_done(lambda: self._sock.send(message, socket.MSG_DONTWAIT), select.POLLOUT, timeout_s)
        except OSError as err:
            self.close()
            raise RemoteGrammarError(f"grammar channel {self.path}: {err}", UNAVAILABLE) from err

    def _until_done(self, call: Callable[[], _T], events: int, timeout_s: float | None) -> _T:
        """``call`` (a socket call made with ``MSG_DONTWAIT``) once the socket has ``events``, waiting at most
        ``timeout_s`` in all (None: as long as it takes); TimeoutError past it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        fd = self._sock.fileno()
        if fd < 0:
            raise OSError(errno.EBADF, "the channel was closed")
        poller = select.poll()
        poller.register(fd, events)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("timed out")
            poller.poll(None if left is None else left * 1000.0)
            try:
                return call()
            except BlockingIOError:  # woken without room or data after all: wait again
                continue

    def _receive(self) -> tuple[memoryview, float]:
        """The next reply and when it arrived (``time.time()``'s clock; now where the kernel gave no stamp)."""
        try:
            try:
                # A step's reply has usually arrived during the caller's forward: one call.
                n, ancillary, _, _ = self._sock.recvmsg_into([self._buf], _STAMP_SPACE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                n, ancillary, _, _ = self._until_done(
                    lambda: self._sock.recvmsg_into([self._buf], _STAMP_SPACE, socket.MSG_DONTWAIT), select.POLLIN,
                    self._wait_s)
        except OSError as err:
            self.close()
            raise RemoteGrammarError(f"grammar channel {self.path}: {err}", UNAVAILABLE) from err
        if n == 0:
            self.close()
            raise RemoteGrammarError(f"grammar channel {self.path}: the grammar model closed it", UNAVAILABLE)
        arrived = time.time()
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
                sec, nsec = _TIMESPEC.unpack_from(data)
                arrived = sec + nsec * 1e-9
        return self._view[:n], arrived

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (by :meth:`close` or after a failure)."""
        return self._sock.fileno() < 0

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self._sock.close()
