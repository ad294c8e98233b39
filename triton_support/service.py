"""The logic of the ``grammar`` Triton model, as plain dataclasses in and out.

``model_repository/grammar/1/model.py`` only converts pb_utils tensors to a
:class:`GrammarRequest` and a :class:`GrammarReply` back to tensors.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

import contract
from grammar_backend.errors import ConstraintError, GrammarError
from grammar_backend.llg import LlgBackend
from grammar_backend.protocol import MaskStep, bitmask_width
from grammar_backend.spec import ConstraintSpec, SpecLimits, constraint_spec
from grammar_backend.tokenizer import load_tokenizer
from grammar_service import auto_switch
from grammar_service.cache import STORE_MAX_BYTES, CacheConfig
from grammar_service.cpus import auto_fill_threads, usable_cpus
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from grammar_service.table import TableConfig
from grammar_service.transport.channel import ChannelServer, ChannelStart, ChannelStep
from grammar_service.transport.maskbuf import Attached
from grammar_service.workers import WorkerConfig
from telemetry import LatencyWindow, Snapshot

OPS = ("start", "step", "rollback", "end", "stats", "channel")


log = logging.getLogger(__name__)

@dataclass(frozen=True)
class GrammarModelConfig:
    """Parameters of the ``grammar`` model (``config.pbtxt``), all strings there.

    ``tokenizer`` is a local Hugging Face folder or GGUF file; ``vocab_size``
    must equal the language model's logits width (0: take it from the
    folder's config.json); ``stop_token_ids`` empty: the tokenizer's own.
    ``compile_workers`` worker processes compile (``compile_queue`` more
    distinct compiles may wait; beyond, RESOURCE_EXHAUSTED); a start waits
    ``compile_timeout_s`` for its compile; a compile is stopped past
    ``compile_cpu_s`` CPU seconds (twice that in wall time) or
    ``compile_memory_bytes`` of memory, and refused when its grammar exceeds
    ``max_grammar_bytes`` (see :mod:`grammar_service.workers`).
    ``store_dir`` is the on-disk grammar store (empty: none), bounded by
    ``store_max_bytes`` (empty: :data:`~grammar_service.cache.STORE_MAX_BYTES`).
    ``fill_threads`` 0 takes :func:`~grammar_service.cpus.auto_fill_threads` of the
    CPUs this process may use (:func:`~grammar_service.cpus.usable_cpus`).
    Compiles of constraints over ``heavy_constraint_bytes`` leave a compile
    thread of each backend to smaller ones.
    """

    tokenizer: str
    vocab_size: int = 0
    stop_token_ids: tuple[int, ...] = ()
    max_batch: int = 256
    fill_threads: int = 0
    compile_threads: int = 1
    compile_workers: int = 2
    compile_queue: int = 8
    compile_timeout_s: float = 20.0
    compile_cpu_s: float = 30.0
    compile_memory_bytes: int = 1024 * 1024 * 1024
    max_grammar_bytes: int = 64 * 1024 * 1024
    cache_max_bytes: int = 512 * 1024 * 1024
    negative_ttl_s: float = 30.0
    store_dir: str | None = None
    store_max_bytes: int | None = None
    capacity: int = 1024
    idle_ttl_s: float = 600.0
    max_payload_bytes: int = contract.MAX_CONSTRAINT_BYTES
    max_depth: int = contract.MAX_CONSTRAINT_DEPTH
    heavy_constraint_bytes: int = contract.HEAVY_CONSTRAINT_BYTES

    def engine_config(self) -> GrammarEngineConfig:
        """The :class:`GrammarEngineConfig` these parameters describe."""
        cpus = usable_cpus()
        fill_threads = self.fill_threads or auto_fill_threads(cpus)
        return GrammarEngineConfig(
            max_batch=self.max_batch,
            fill_threads=fill_threads,
            # The pipelined fill overlaps the step thread's planning with the fill: it needs a CPU the fill
            # threads leave free (with none, 1.02x at 256 rows, 2 threads on 2 CPUs: docs/benchmarks.md).
            pipeline_rows=GrammarEngineConfig.pipeline_rows if fill_threads < cpus else 0,
            heavy_constraint_bytes=self.heavy_constraint_bytes,
            cache=CacheConfig(
                max_bytes=self.cache_max_bytes,
                workers=self.compile_workers,
                max_queued=self.compile_queue,
                timeout_s=self.compile_timeout_s,
                negative_ttl_s=self.negative_ttl_s,
                store_dir=self.store_dir,
                store_max_bytes=STORE_MAX_BYTES if self.store_max_bytes is None else self.store_max_bytes,
            ),
            workers=WorkerConfig(
                cpu_s=self.compile_cpu_s,
                memory_bytes=self.compile_memory_bytes,
                max_grammar_bytes=self.max_grammar_bytes,
                compile_threads=self.compile_threads,
            ),
            table=TableConfig(capacity=self.capacity, idle_ttl_s=self.idle_ttl_s),
            limits=SpecLimits(max_payload_bytes=self.max_payload_bytes, max_depth=self.max_depth),
        )

    def build_engine(self) -> GrammarEngine:
        """Load the tokenizer and build the engine."""
        bundle = load_tokenizer(
            self.tokenizer,
            vocab_size=self.vocab_size or None,
            stop_token_ids=list(self.stop_token_ids) or None,
        )
        llg: LlgBackend | None = None
        try:
            llg = LlgBackend(bundle.hf, bundle.vocab_size, bundle.stop_token_ids)
        except ValueError as err:  # llguidance takes fast (Rust) tokenizers only
            log.warning("grammar: the llguidance backend is off for %s (%s): backend auto serves with xgrammar, "
                        "backend llguidance is refused", self.tokenizer, err)
        return GrammarEngine(bundle.info, bundle.fingerprint, self.engine_config(), encode=bundle.encode, llg=llg,
                             special_ids=bundle.special_ids())


@dataclass(frozen=True)
class GrammarRequest:
    """One request to the grammar model (see the model's tensor contract)."""

    op: str
    seq_ids: np.ndarray
    tokens: np.ndarray | None = None
    counts: np.ndarray | None = None
    grammar_type: str = ""
    grammar: bytes = b""
    grammar_options: bytes = b""
    validated: bool = False
    jump_forward: bool = False
    budget: int = 0
    mask_buffer: str = ""
    value_checks: bool = False
    drafts: np.ndarray | None = None  # step: int32 [B, D] draft tokens (speculative decoding)
    draft_counts: np.ndarray | None = None  # step: int32 [B], with drafts


@dataclass(frozen=True)
class GrammarReply:
    """The tensors of one response; None fields are not sent."""

    active: int
    #: step: the answer (:mod:`grammar_backend.protocol`); its bitmask is the caller's mask buffer where
    #: the step named one (``bitmask_in_buffer``: not sent as a tensor).
    step: MaskStep | None = None
    bitmask_in_buffer: bool = False
    row_errors: list[str] = field(default_factory=list)  # rollback: empty where no row failed
    stats: str | None = None
    backend: str | None = None  # start: the backend that serves the sequence
    channel: str | None = None  # channel: the grammar channel's socket (grammar_service.transport.channel)


class GrammarService:
    """Dispatches grammar-model requests to a :class:`GrammarEngine`.

    The model serves ``start`` with :meth:`start_async` (a compile holds no
    thread); every other op is fast and runs inline through :meth:`handle`,
    from the model's ``execute`` (BLS) or from a grammar channel
    connection's thread (:meth:`channel_step`, :meth:`channel_start`,
    :meth:`channel_end`): one lock keeps the non-start ops one at a time, as
    the engine's step buffers and the matchers need.
    """

    def __init__(self, engine: GrammarEngine) -> None:
        self.engine = engine
        self.step_latency = LatencyWindow()
        self.buffers = Attached(bitmask_width(engine.vocab_size))
        self._ops = threading.Lock()
        self._channel: ChannelServer | None = None

    def open_channel(self, on_served: Callable[[str], None] | None = None) -> str:
        """Listen on the grammar channel (:mod:`grammar_service.transport.channel`); returns the socket's path.

        ``on_served`` gets each served request's op name, on its connection's thread.

        Raises
        ------
        GrammarError
            The socket cannot be created.
        """
        if self._channel is None:
            self._channel = ChannelServer(self, on_served=on_served)
        return str(self._channel.path)

    def close_channel(self) -> None:
        """Stop the grammar channel (callers fall back to BLS)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- the grammar channel's requests (grammar_service.transport.channel.ChannelHandler) ----------
    def channel_step(self, step: ChannelStep) -> MaskStep:
        """A step that came over the channel: exactly :meth:`handle`'s ``step``."""
        reply = self.handle(GrammarRequest(op="step", seq_ids=step.seq_ids, tokens=step.tokens, counts=step.counts,
                                           jump_forward=step.jump_forward, mask_buffer=step.mask_buffer,
                                           drafts=step.drafts, draft_counts=step.draft_counts))
        if reply.step is None:
            raise GrammarError("grammar: a step without its answer")
        return reply.step

    def channel_start(self, start: ChannelStart) -> str:
        """A start that came over the channel: :meth:`start_async`, waited for; returns the backend.

        Raises
        ------
        GrammarError
            The start's error (bad constraint, compile failure or timeout, ...).
        """
        done = threading.Event()
        outcome: list[GrammarReply | GrammarError] = []

        def finished(result: GrammarReply | GrammarError) -> None:
            outcome.append(result)
            done.set()

        self.start_async(GrammarRequest(
            op="start", seq_ids=np.array([start.seq_id], np.uint64), grammar_type=start.kind, grammar=start.payload,
            grammar_options=start.options, validated=start.validated, budget=start.budget,
            value_checks=start.value_checks), finished)
        done.wait()  # the engine bounds the compile (compile_timeout_s), and calls back exactly once
        result = outcome[0]
        if isinstance(result, GrammarError):
            raise result
        if result.backend is None:
            raise GrammarError("grammar: a start reply without BACKEND")
        return result.backend

    def channel_end(self, seq_ids: Sequence[int]) -> int:
        """An end that came over the channel; returns the sequences still active."""
        return self.handle(GrammarRequest(op="end", seq_ids=np.asarray(seq_ids, np.uint64))).active

    def metrics_snapshot(self) -> Snapshot:
        """The ``grammar`` metrics of :mod:`triton_support.metrics`, now."""
        eng = self.engine
        snap = Snapshot()
        snap.put("grammar_active_sequences", eng.active_count)
        for backend, cache in eng.caches().items():
            c = cache.stats()
            snap.put("grammar_cache_bytes", c.bytes_in_use, backend=backend)
            snap.put("grammar_cache_entries", c.entries, backend=backend)
            snap.put("grammar_compiles_in_flight", c.in_flight, backend=backend)
            snap.put("grammar_cache_hits_total", c.hits, backend=backend)
            snap.put("grammar_cache_misses_total", c.misses, backend=backend)
            snap.put("grammar_cache_evictions_total", c.evictions, backend=backend)
            snap.put("grammar_compiles_total", c.compiles, backend=backend)
            snap.put("grammar_compile_failures_total", c.compile_failures, backend=backend)
            snap.put("grammar_compile_timeouts_total", c.timeouts, backend=backend)
            snap.put("grammar_compile_seconds_total", c.compile_seconds, backend=backend)
        store = eng.cache.stats().store  # xgrammar's only: llguidance's lazy compiles are not worth storing
        snap.put("grammar_store_hits_total", store.hits)
        snap.put("grammar_store_bytes", store.bytes)
        snap.put("grammar_store_evictions_total", store.evictions)
        for op, reasons in store.write_failures.items():
            for reason, n in reasons.items():
                snap.put("grammar_store_write_failures_total", n, op=op, reason=reason)
        for reason, n in store.read_failures.items():
            snap.put("grammar_store_read_failures_total", n, reason=reason)
        starts = eng.starts()
        for backend in contract.BACKENDS:
            snap.put("grammar_starts_total", starts.get(backend, 0), backend=backend)
        snap.put("grammar_backend_fallbacks_total", eng.fallbacks)
        switches = eng.switches()
        for outcome in auto_switch.OUTCOMES:
            snap.put("grammar_auto_switches_total", switches.get(outcome, 0), outcome=outcome)
        snap.put("grammar_value_retries_total", eng.values.backtracks)
        snap.put("grammar_value_unfixed_total", eng.values.unfixable)
        snap.put_latency("grammar_step_seconds", self.step_latency)
        return snap

    def start_async(self, req: GrammarRequest, done: Callable[[GrammarReply | GrammarError], None]) -> None:
        """Serve a ``start``: ``done`` gets the reply or the error, exactly once, maybe later.

        Parsing happens on the calling thread (bounded by the spec limits);
        the compile does not.
        """
        try:
            seq_id, spec = self._start_args(req)
            self.engine.start_async(
                seq_id,
                spec,
                lambda err: done(err if err is not None else self._started(seq_id)),
                budget=req.budget,
                value_checks=req.value_checks,
            )
        except GrammarError as err:
            done(err)

    def _started(self, seq_id: int) -> GrammarReply:
        backend = self.engine.table.get(seq_id).backend
        return GrammarReply(active=self.engine.active_count, backend=backend)

    def _start_args(self, req: GrammarRequest) -> tuple[int, ConstraintSpec]:
        if len(req.seq_ids) != 1:
            raise ConstraintError("SEQUENCE_ID", f"start takes exactly one sequence, got {len(req.seq_ids)}")
        if req.budget < 0:
            raise ConstraintError("MAX_TOKENS", f"must be >= 0 (0: no budget closing), got {req.budget}")
        return int(req.seq_ids[0]), constraint_spec(
            req.grammar_type, req.grammar, req.grammar_options, self.engine.config.limits, validated=req.validated
        )

    def handle(self, req: GrammarRequest) -> GrammarReply:
        """Serve one request.

        Raises
        ------
        GrammarError
            A request-level error (bad constraint, compile failure or timeout,
            duplicate start, malformed batch); row errors are not raised but
            returned (a step's in its answer's ``errors``, a rollback's in ``row_errors``).
        """
        eng = self.engine
        if req.op not in OPS:
            raise ConstraintError("OP", f"unknown op {req.op!r}; expected one of {', '.join(OPS)}")
        if req.op == "start":
            seq_id, spec = self._start_args(req)
            eng.start(seq_id, spec, budget=req.budget, value_checks=req.value_checks)
            return self._started(seq_id)
        if req.op == "channel":
            if self._channel is None:
                raise GrammarError("grammar: the grammar channel is not open")
            return GrammarReply(active=eng.active_count, channel=str(self._channel.path))
        with self._ops:
            return self._serial(req)

    def _serial(self, req: GrammarRequest) -> GrammarReply:
        """The ops that run one at a time (under ``_ops``)."""
        eng = self.engine
        if req.op == "end":
            eng.end([int(s) for s in req.seq_ids])
            return GrammarReply(active=eng.active_count)
        if req.op == "stats":
            stats = {
                "active": eng.active_count,
                "evicted": eng.table.evicted,
                **asdict(eng.cache.stats()),
                "workers": asdict(eng.workers.stats()),
                "llguidance": asdict(eng.llg_cache.stats()),
            }
            return GrammarReply(active=eng.active_count, stats=json.dumps(stats))
        rows = len(req.seq_ids)
        counts = req.counts if req.counts is not None else np.zeros(rows, np.int32)
        if req.op == "rollback":
            errors = eng.rollback([int(s) for s in req.seq_ids], [int(c) for c in counts])
            return GrammarReply(active=eng.active_count, row_errors=[str(e) if e else "" for e in errors])
        tokens = req.tokens if req.tokens is not None else np.zeros((rows, 0), np.int32)
        t0 = time.perf_counter()
        # The draft masks follow the step's rows in the caller's buffer: [D, B, W] after its first B rows.
        width = 0 if req.drafts is None or req.drafts.ndim != 2 else int(req.drafts.shape[1])
        # The caller's buffer is checked before any token is accepted: a bad one fails the step whole.
        buffer = self.buffers.rows(req.mask_buffer, rows * (1 + width)) if req.mask_buffer else None
        draft_out = None if buffer is None or not width else buffer[rows:].reshape(width, rows, buffer.shape[1])
        if buffer is not None:
            buffer = buffer[:rows]
        out = eng.step(req.seq_ids, tokens, counts, jump_forward=req.jump_forward, out=buffer, drafts=req.drafts,
                       draft_counts=req.draft_counts, draft_out=draft_out)
        seconds = time.perf_counter() - t0
        self.step_latency.add(seconds)
        # The per-row arrays are copied (B bytes each): the engine's buffers are the next step's, which
        # another caller's thread may run before this reply is sent.
        answer = out.answer(jump_forward=req.jump_forward, copy=True, bitmask=buffer, draft_bitmask=draft_out,
                            seconds=seconds, active=eng.active_count)
        return GrammarReply(active=answer.active, step=answer, bitmask_in_buffer=buffer is not None)
