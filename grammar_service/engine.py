"""The engine-level object: tokenizer info, compile cache, sequence table, bitmask."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xgrammar as xgr

import contract
from grammar_backend.backends import LLGUIDANCE, XGRAMMAR, auto_order
from grammar_backend.bitmask import ALL_ALLOWED, BitmaskBuffer, Matcher, few_allowed, pack_tokens
from grammar_backend.closing import Closer, ClosingConfig
from grammar_backend.compile import XGRAMMAR_VERSION
from grammar_backend.errors import (
    BackendFailed,
    CompileError,
    ConfigError,
    DuplicateSequence,
    GrammarError,
    MatcherFailed,
    SequenceError,
)
from grammar_backend.jump import Encoder, JumpForward, PrefixIndex, pack_forced
from grammar_backend.llg import LLGUIDANCE_VERSION, LlgBackend, LlgCompiled, refusal
from grammar_backend.lru import Lru
from grammar_backend.protocol import MaskStep
from grammar_backend.reasoning import MarkerTable, ReasoningConfig
from grammar_backend.sequences import FREE, GrammarSequence
from grammar_backend.spec import ConstraintSpec, SpecLimits
from grammar_backend.values import ValueChecks, rules_for
from grammar_service.auto_switch import AutoSwitch
from grammar_service.cache import CacheConfig, CompileCache
from grammar_service.deadlines import Deadlines
from grammar_service.fill_pipeline import FillPipeline
from grammar_service.llg_spread import TemplateSpread
from grammar_service.table import SequenceTable, TableConfig
from grammar_service.workers import CompileWorkers, WorkerConfig

#: Most tokens a calm row of a regex, a grammar or a choice is screened over (:meth:`GrammarSequence.screen`:
#: one completion search each); where its grammar allows more (free text), the completion's next token alone.
_SCREEN_MOST = 16
#: Packed calm rows kept (two per set of structural-tag segment openers: :meth:`GrammarEngine._calm_row`).
_CALM_ROWS = 16
#: Weight of a pipelined step's own per-row seconds in the moving averages that place the next one's hand-over.
_SPLIT_WEIGHT = 0.25

log = logging.getLogger(__name__)

#: Called once with None (the sequence's matcher exists) or the start's error.
StartCallback = Callable[[GrammarError | None], None]


@dataclass(frozen=True)
class GrammarEngineConfig:
    """Grammar-engine settings (one per grammar model instance).

    Parameters
    ----------
    max_batch : int
        Most rows of one step (the bitmask buffer's height).
    fill_threads : int
        Threads of the batched bitmask fill.
    cache, workers, table, limits, closing
        See :class:`CacheConfig`, :class:`WorkerConfig`, :class:`TableConfig`,
        :class:`SpecLimits`, :class:`ClosingConfig`.
    auto_timeout_s : float
        ``backend: auto``: how long a start waits for the first backend's
        compile before the other serves it (:func:`auto_order`; the compile
        goes on and is cached).  xgrammar's compile has a long tail: p50
        0.03 s, p99 13.9 s over maskbench-dev, non-strict (``bench/maskbench.py
        ../shared/data/maskbench-dev --backend xgrammar``); llguidance's p50
        2 ms (``--backend auto``).
    llg_compile_threads : int
        Threads of the llguidance compile cache (a compile builds and checks
        an ``LLMatcher``; its lexer is built lazily).  Two: a heavy compile
        (a 1.9 MB schema took 8 s) holds one, the other stays for small ones.
    heavy_constraint_bytes : int
        A constraint larger than this is heavy: its compiles hold at most all
        but one compile thread of each backend (:meth:`CompileCache.get_future`).
    reasoning : ReasoningConfig
        What the thinking section of a ``reasoning`` request leaves to the
        answer (:mod:`grammar_backend.reasoning`).
    max_draft_tokens : int
        Most draft tokens a row of a step may carry (:meth:`GrammarEngine.step`'s ``drafts``).
    pipeline_rows : int
        The fewest rows of a step whose first rows are filled on a thread of their own while the step thread
        plans the rest (:mod:`grammar_service.fill_pipeline`); 0: never.  Below it a step fills after planning:
        the hand-over (two thread wake-ups) and the fill's pressure on the planning thread cost about what a
        small batch hides (the in-process step pipelined over not, 2 CPUs, 1 fill thread, xgrammar: 0.99 at 64
        rows, 0.93 at 128, 0.87 at 256; ``bench/grammar_step_bench.py --fill-states --rows R``).
    """

    max_batch: int = 256
    fill_threads: int = 1
    auto_timeout_s: float = 5.0
    llg_compile_threads: int = 2
    heavy_constraint_bytes: int = contract.HEAVY_CONSTRAINT_BYTES
    max_draft_tokens: int = contract.MAX_DRAFT_TOKENS
    pipeline_rows: int = 128
    closing: ClosingConfig = field(default_factory=ClosingConfig)
    reasoning: ReasoningConfig = field(default_factory=ReasoningConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    workers: WorkerConfig = field(default_factory=WorkerConfig)
    table: TableConfig = field(default_factory=TableConfig)
    limits: SpecLimits = field(default_factory=SpecLimits)

    def __post_init__(self) -> None:
        if min(self.max_batch, self.fill_threads, self.llg_compile_threads) <= 0 or not self.auto_timeout_s > 0:
            raise ConfigError("engine: max_batch, fill_threads, llg_compile_threads and auto_timeout_s must be positive")
        if not 0 <= self.max_draft_tokens <= contract.MAX_DRAFT_TOKENS:
            raise ConfigError(f"engine: max_draft_tokens must be within 0..{contract.MAX_DRAFT_TOKENS}, "
                              f"got {self.max_draft_tokens}")
        if self.pipeline_rows < 0:
            raise ConfigError(f"engine: pipeline_rows must be 0 (never) or positive, got {self.pipeline_rows}")


@dataclass(frozen=True)
class StepResult:
    """What one step returns for a batch of B rows.

    Attributes
    ----------
    bitmask : numpy.ndarray
        int32 ``[B, ceil(V/32)]``, a view of the engine's reused buffer:
        valid until the next :meth:`GrammarEngine.step`.
    terminated : numpy.ndarray
        bool ``[B]``: the row's grammar accepted its stop token.
    errors : tuple
        Per row, None or the error of that row (unknown sequence, rejected
        token); an error row's mask is all ones and must not be sampled.
    forced : tuple
        Per row, jump-forward tokens (empty unless requested, enabled by the
        sequence's ``jump_forward`` option and available; never for a row
        whose completion is being forced), see :class:`~grammar_backend.jump.JumpForward`.
    closing : numpy.ndarray
        int8 ``[B]``: the row's :class:`~grammar_backend.protocol.CloseState`
        (non-zero: its mask forces a completion because the budget runs out or
        the output repeats itself).  A view of a reused buffer, like ``bitmask``.
    dropped : numpy.ndarray
        int32 ``[B]``: tokens the row's value check dropped at this step (a
        completed value broke the schema: :mod:`grammar_backend.values`).  The
        caller drops as many of the row's last tokens, and feeds the row again
        from the token before them; its mask here is for that position and is
        not sampled this step.  A reused buffer's view.
    hold : numpy.ndarray
        int32 ``[B]``: how many of the row's last tokens a value check may
        still drop (stream nothing of them yet).  A reused buffer's view.
    forced_safe : numpy.ndarray
        int32 ``[B]``: for a row whose forced tokens start its output, how
        many of the first of them no value check can drop once accepted
        (0 elsewhere: the caller holds forced tokens until the next step's
        ``hold``).  A reused buffer's view.
    draft_bitmask : numpy.ndarray or None
        With ``drafts``: int32 ``[K, B, ceil(V/32)]``, ``draft_bitmask[j, i]``
        the mask of the position after row ``i``'s drafts ``0..j`` (its mask
        after its new tokens is ``bitmask[i]``).  A reused buffer's view.
    draft_valid : numpy.ndarray or None
        With ``drafts``: int32 ``[B]``, how many of row ``i``'s draft masks
        hold (the rest are all ones): up to the first draft the mask before
        it forbids (the target cannot accept it, nor what follows), one
        after which the grammar has ended, or the row's draft count.
        A reused buffer's view.
    draft_closing : numpy.ndarray or None
        With ``drafts``: int8 ``[B, K]``, the close state of each position a
        draft reaches (as ``closing``; 0 past ``draft_valid[i]``).  A reused
        buffer's view.
    """

    bitmask: np.ndarray
    terminated: np.ndarray
    errors: tuple[SequenceError | None, ...]
    forced: tuple[tuple[int, ...], ...]
    closing: np.ndarray
    dropped: np.ndarray
    hold: np.ndarray
    forced_safe: np.ndarray
    draft_bitmask: np.ndarray | None = None
    draft_valid: np.ndarray | None = None
    draft_closing: np.ndarray | None = None

    def answer(self, *, jump_forward: bool, copy: bool, bitmask: np.ndarray | None = None,
               draft_bitmask: np.ndarray | None = None, seconds: float = float("nan"), active: int = -1) -> MaskStep:
        """This result as the step protocol's answer (:mod:`grammar_backend.protocol`), the one conversion.

        ``jump_forward``: the step asked for forced tokens.  ``copy``: copy the
        per-row arrays out of the engine's reused buffers (an answer sent by
        another thread after the next step may have run); the bitmask is
        ``bitmask`` where given (the caller's mask buffer, filled already),
        else the engine's (copied too, with ``copy``); the draft masks likewise
        (``draft_bitmask``).  ``dropped`` and
        ``hold`` are None where no row has any, as the protocol sends them.
        """
        def own(a: np.ndarray) -> np.ndarray:
            return a.copy() if copy else a

        forced_tokens, forced_counts = pack_forced(self.forced) if jump_forward else (None, None)
        return MaskStep(
            bitmask=bitmask if bitmask is not None else own(self.bitmask),
            terminated=own(self.terminated),
            errors=tuple(None if e is None else str(e) for e in self.errors),
            closing=own(self.closing),
            forced_tokens=forced_tokens,
            forced_counts=forced_counts,
            dropped=own(self.dropped) if self.dropped.any() else None,
            hold=own(self.hold) if self.hold.any() else None,
            forced_safe=own(self.forced_safe) if jump_forward else None,
            draft_valid=None if self.draft_valid is None else own(self.draft_valid),
            draft_closing=None if self.draft_closing is None else own(self.draft_closing),
            draft_bitmask=(None if self.draft_bitmask is None
                           else draft_bitmask if draft_bitmask is not None else own(self.draft_bitmask)),
            grammar_s=seconds,
            active=active,
        )


class GrammarEngine:
    """Compiles constraints once, keeps one matcher per sequence, fills batched masks.

    Parameters
    ----------
    tokenizer_info : xgrammar.TokenizerInfo
        Built with the model's padded vocabulary size and its stop tokens.
    fingerprint : str
        The tokenizer fingerprint (part of every cache key).
    config : GrammarEngineConfig
    encode : callable, optional
        ``text -> token ids`` with the model's tokenizer (no special tokens):
        needed for jump-forward, which spells forced text as the tokenizer does.
    llg : LlgBackend, optional
        The llguidance backend over the same vocabulary (built from the
        Hugging Face tokenizer); without it ``backend: llguidance`` is
        refused and ``auto`` means xgrammar.
    special_ids : iterable of int
        The tokenizer's special tokens that the output text leaves out (Hugging
        Face ``special`` added tokens): masked inside a thinking section
        (:mod:`grammar_backend.reasoning`), with the stop tokens and xgrammar's own special tokens.
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, fingerprint: str, config: GrammarEngineConfig,
                 encode: Encoder | None = None, llg: LlgBackend | None = None,
                 special_ids: Iterable[int] = ()) -> None:
        self.config = config
        self._encode = encode
        #: End-marker tables by marker (:meth:`marker_table`).
        self._markers: Lru[str, MarkerTable] = Lru(config.reasoning.tables)
        self._thinking_banned = frozenset(
            {*map(int, tokenizer_info.stop_token_ids), *map(int, tokenizer_info.special_token_ids), *special_ids})
        self.llg = llg
        #: Which template each llguidance sequence copies (grammar_service.llg_spread).
        self._spread = None if llg is None else TemplateSpread(llg)
        # llguidance compiles in this process on its own threads: queued behind
        # slow xgrammar compiles, the fallback from them would wait for them.
        self.llg_cache = CompileCache(
            dataclasses.replace(config.cache, workers=config.llg_compile_threads, store_dir=None), tokenizer_info)
        #: backend: auto, by the xgrammar cache key: the backend that served the constraint first (sticky,
        #: so a constraint that fell over to llguidance is not tried on xgrammar at every request).
        self._auto: Lru[str, str] = Lru(4096)
        self._counts_lock = threading.Lock()
        self._starts: dict[str, int] = {}
        #: ``backend: auto`` starts that the first backend refused or did not compile in time.
        self.fallbacks = 0
        # Sorted once, shared by jump-forward and the value checks (which build it on first use without one).
        index = None if encode is None else PrefixIndex(tokenizer_info)
        self.jump = None if encode is None else JumpForward(tokenizer_info, encode, index)
        self.values = ValueChecks(tokenizer_info, index)
        self.tokenizer_info = tokenizer_info
        self.fingerprint = fingerprint
        self.vocab_size = int(tokenizer_info.vocab_size)
        # Compiles run in worker processes (grammar_service.workers), each with
        # xgrammar's own compiler cache on, bounded: besides whole grammars it
        # shares compiled sub-structures (strings, numbers, common rules)
        # across schemas: most cold-key compiles get faster, a huge enum slower
        # (docs/benchmarks.md, component costs). CompileCache bounds what
        # sequences can reuse.
        self.workers = CompileWorkers(tokenizer_info, config.workers)
        self._deadlines = Deadlines()
        self.cache = CompileCache(config.cache, tokenizer_info)
        #: backend auto's replay of a JSON constraint's first output on xgrammar (bounded like the compile queue).
        self.auto_switch = AutoSwitch(
            self.vocab_size,
            self._compile_future,
            self._matcher,
            lambda spec: self._auto.set(self._key(spec, XGRAMMAR), XGRAMMAR),
            config.cache.workers + config.cache.max_queued,
            config.cache.timeout_s,
            lambda: self.cache.in_flight() < config.cache.workers,
        )
        self.table = SequenceTable(config.table)
        self.bitmask = BitmaskBuffer(config.max_batch, self.vocab_size, config.fill_threads)
        self._pipeline = FillPipeline(self.bitmask) if 0 < config.pipeline_rows <= config.max_batch else None
        # Seconds per row of the last pipelined steps' planning and fill: where the next one hands its rows over.
        self._plan_row_s = self._fill_row_s = 0.0
        self._terminated = np.zeros(config.max_batch, dtype=bool)
        self._closing = np.zeros(config.max_batch, dtype=np.int8)
        self._dropped = np.zeros(config.max_batch, dtype=np.int32)
        self._hold = np.zeros(config.max_batch, dtype=np.int32)
        self._forced_safe = np.zeros(config.max_batch, dtype=np.int32)
        self._ban_rows: list[tuple[int, np.ndarray]] = []  # reused: (row, what its bans leave allowed)
        self._forced_rows: list[tuple[int, int]] = []  # reused: (row, token) forced this step
        self._calm_rows: list[tuple[int, int, GrammarSequence]] = []  # reused: (row, completion token, its sequence)
        self._draft_seqs: list[tuple[int, GrammarSequence]] = []  # reused: (row, sequence) with drafts this step
        #: The draft masks, ``[K, max_batch, width]``, grown to the most draft tokens a step has carried.
        self._draft_masks = np.full((0, config.max_batch, self.bitmask.width), -1, dtype=np.int32)
        self._draft_valid = np.zeros(config.max_batch, dtype=np.int32)
        self._draft_closing = np.zeros((config.max_batch, 0), dtype=np.int8)  # [max_batch, K], grown as the masks
        self.closer = Closer(tokenizer_info, config.closing.search)
        #: Packed calm rows by (whole characters only, more openers): see :meth:`Closer.calm_tokens`.
        self._calm: Lru[tuple[bool, bytes], np.ndarray] = Lru(_CALM_ROWS)
        for whole in (False, True):  # every constraint but a structural tag uses these two
            self._calm_row(whole, b"")
        stops = [int(t) for t in tokenizer_info.stop_token_ids]
        if not stops:
            raise ConfigError("engine: the tokenizer has no stop token (closing forces one)")
        self._stop_token = stops[0]
        self._no_errors: tuple[None, ...] = (None,) * config.max_batch
        self._no_forced: tuple[tuple[int, ...], ...] = ((),) * config.max_batch

    @property
    def active_count(self) -> int:
        """Number of sequences holding a matcher."""
        return len(self.table)

    def warm_up(self) -> None:
        """Start every compile worker process now (seconds each), instead of on the first compiles."""
        self.cache.on_each_thread(self.workers.ensure_started)

    def compile(self, spec: ConstraintSpec, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """xgrammar's compiled grammar of ``spec`` (cached; single-flight; in a worker process; with a timeout).

        Raises
        ------
        CompileError, CompileTimeout, CompileQueueFull
        """
        return self.cache.get(self._key(spec, XGRAMMAR), self._compile_fn(spec, XGRAMMAR), timeout_s)

    def caches(self) -> dict[str, CompileCache]:
        """The compile cache of each backend (``contract.BACKENDS``), for its counters."""
        return {XGRAMMAR: self.cache, LLGUIDANCE: self.llg_cache}

    def starts(self) -> dict[str, int]:
        """Sequences started so far, by the backend that serves them."""
        with self._counts_lock:
            return dict(self._starts)

    def backends(self, spec: ConstraintSpec) -> tuple[str, ...]:
        """The backends a start of ``spec`` tries, in order.

        Raises
        ------
        CompileError
            ``backend: llguidance`` on an engine without it.
        """
        choice = spec.options.backend
        if choice == "auto":
            if self.llg is None or refusal(spec) is not None:
                return (XGRAMMAR,)
            served = self._auto.get(self._key(spec, XGRAMMAR))
            return (served,) if served is not None else auto_order(spec)
        if choice == LLGUIDANCE:
            self._llg()  # refused now on an engine without it
        return (choice,)

    def start(self, seq_id: int, spec: ConstraintSpec, timeout_s: float | None = None, budget: int = 0,
              value_checks: bool = False) -> None:
        """Blocking form of :meth:`start_async`.

        Raises
        ------
        CompileError, CompileTimeout, CompileQueueFull, DuplicateSequence, CapacityExceeded
        """
        done = threading.Event()
        outcome: list[GrammarError | None] = []

        def finish(err: GrammarError | None) -> None:
            outcome.append(err)
            done.set()

        self.start_async(seq_id, spec, finish, timeout_s, budget, value_checks)
        done.wait()
        if outcome[0] is not None:
            raise outcome[0]

    def start_async(
        self,
        seq_id: int,
        spec: ConstraintSpec,
        done: StartCallback,
        timeout_s: float | None = None,
        budget: int = 0,
        value_checks: bool = False,
    ) -> None:
        """Compile (or fetch) the grammar of ``spec``, then create the sequence's matcher.

        ``budget`` is the request's ``max_tokens`` (0: unknown, no budget
        closing; see :class:`~grammar_backend.sequences.GrammarSequence`).
        ``value_checks``: the caller can drop tokens the step reports in
        ``StepResult.dropped``, so values are checked as they complete
        (:mod:`grammar_backend.values`, up to the ``value_retries`` option).

        Never blocks on a compile: ``done`` is called exactly once, with None
        once the matcher exists or with the error, from this thread (cache
        hit, immediate failure), a compile thread, or the deadline thread
        when the compile outlives ``timeout_s`` (default: the cache's).  A
        start that timed out never creates its matcher later.

        Raises
        ------
        DuplicateSequence, CompileQueueFull
            Before anything is queued (``done`` is not called).
        """
        if seq_id in self.table:
            # Checked before compiling too, so a duplicate costs no compile.
            raise DuplicateSequence(seq_id, "already started")
        self._attempt(seq_id, spec, self.backends(spec), done, timeout_s, budget, value_checks)

    def _attempt(self, seq_id: int, spec: ConstraintSpec, backends: tuple[str, ...], done: StartCallback,
                 timeout_s: float | None, budget: int, value_checks: bool,
                 first: GrammarError | None = None) -> None:
        """Start with ``backends[0]``; on its compile failing or running out of time, with the next one.

        When every backend fails, the error is the first one's (the primary backend's reason),
        naming the others' reasons too.
        """
        backend, rest = backends[0], backends[1:]
        cache = self.cache if backend == XGRAMMAR else self.llg_cache
        future = self._compile_future(spec, backend)
        claimed = threading.Lock()  # whoever acquires it answers: the compile or the deadline

        def fall_over(err: GrammarError) -> None:
            if not rest:
                done(err if first is None else _also(first, backend, err))
                return
            log.info("grammar: sequence %d: %s failed (%s); trying %s", seq_id, backend, err, rest[0])
            with self._counts_lock:
                self.fallbacks += 1
            try:
                self._attempt(seq_id, spec, rest, done, timeout_s, budget, value_checks, first or err)
            except GrammarError as again:
                done(again)

        def on_compiled(fut: Future[Any]) -> None:
            if not claimed.acquire(blocking=False):
                return
            if deadline is not None:
                deadline.cancel()
            try:
                compiled = fut.result()
            except GrammarError as err:
                fall_over(err)
                return
            except Exception as err:
                log.exception("grammar: compile for sequence %d failed", seq_id)
                done(_internal(f"compiling for sequence {seq_id}", err))
                return
            try:
                retries = spec.options.value_retries if value_checks else 0
                rules = rules_for(spec, backend) if retries else None
                seq = self.table.start(seq_id, spec, self._matcher(compiled), backend, budget, self.config.closing)
                if rules is not None:
                    seq.check_values(self.values, rules, retries)
                if seq.closes and seq.close.openers:
                    for whole in (False, True):
                        self._calm_row(whole, seq.close.openers)
                thinking = spec.options.reasoning
                if thinking is not None:
                    seq.think(self.marker_table(thinking.end), thinking.max_reasoning_tokens or 0,
                              self.config.reasoning)
            except GrammarError as err:
                done(err)
                return
            except Exception as err:
                log.exception("grammar: start of sequence %d failed", seq_id)
                done(_internal(f"starting sequence {seq_id}", err))
                return
            if spec.options.backend == "auto":
                key = self._key(spec, XGRAMMAR)
                # Only the first: a start begun before a switch to xgrammar must not undo it.
                if self._auto.get(key) is None:
                    self._auto.put(key, backend)
                if backend == LLGUIDANCE and spec.kind.is_json and self.auto_switch.wants(key):
                    seq.recording = []  # its output, once complete, is replayed on xgrammar (auto_switch)
            with self._counts_lock:
                self._starts[backend] = self._starts.get(backend, 0) + 1
            done(None)

        def on_deadline() -> None:
            if claimed.acquire(blocking=False):
                fall_over(cache.timed_out(limit))

        deadline = None
        if not future.done():
            limit = self.cache.config.timeout_s if timeout_s is None else timeout_s
            if rest:
                limit = min(limit, self.config.auto_timeout_s)
            deadline = self._deadlines.call_later(limit, on_deadline)
        future.add_done_callback(on_compiled)

    def switches(self) -> dict[str, int]:
        """``backend: auto``'s replays of JSON constraints llguidance served first, by outcome
        (:data:`grammar_service.auto_switch.OUTCOMES`)."""
        return self.auto_switch.counts()

    def _calm_row(self, whole_chars: bool, openers: bytes) -> np.ndarray:
        """The packed row of :meth:`Closer.calm_tokens` (built once per set of openers, a scan of the
        vocabulary: a sequence's start builds it, not its step)."""
        key = (whole_chars, openers)
        row = self._calm.get(key)
        if row is None:
            row = self._calm.put(key, pack_tokens(self.closer.calm_tokens(*key), self.vocab_size))
        return row

    def marker_table(self, end: str) -> MarkerTable:
        """The table of the end marker ``end`` over this engine's vocabulary (built once, kept in an LRU)."""
        table = self._markers.get(end)
        if table is None:
            table = self._markers.put(end, MarkerTable(end.encode("utf-8"), self.values.index, self.vocab_size,
                                                       self._thinking_banned, self._spell_exactly))
        return table

    def _spell_exactly(self, data: bytes) -> tuple[int, ...] | None:
        """``data`` as the tokenizer spells it where that round-trips (the model's own spelling of a
        marker), else the closer's longest-match spelling; None when neither spells it exactly."""
        if self._encode is not None:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = ""
            if text:
                ids = tuple(int(t) for t in self._encode(text))
                vocab = self.values.index.vocab
                if ids and all(0 <= t < len(vocab) and t not in self._thinking_banned for t in ids) and \
                        b"".join(vocab[t] for t in ids) == data:
                    return ids
        return self.closer.spell(data) or None

    def _key(self, spec: ConstraintSpec, backend: str) -> str:
        version = f"xgrammar {XGRAMMAR_VERSION}" if backend == XGRAMMAR else f"llguidance {LLGUIDANCE_VERSION}"
        return spec.cache_key(self.fingerprint, version)

    def _compile_future(self, spec: ConstraintSpec, backend: str) -> Future[Any]:
        """The compile of ``spec`` on ``backend``: cached, joined, or queued (heavy ones within their share)."""
        cache = self.cache if backend == XGRAMMAR else self.llg_cache
        return cache.get_future(self._key(spec, backend), self._compile_fn(spec, backend), self._heavy(spec))

    def _heavy(self, spec: ConstraintSpec) -> bool:
        return len(spec.payload) > self.config.heavy_constraint_bytes

    def _compile_fn(self, spec: ConstraintSpec, backend: str) -> Callable[[], Any]:
        if backend == XGRAMMAR:
            return lambda: self.workers.compile(spec)
        llg = self._llg()
        # Up to a template per fill thread (LlgCompiled), but one for a heavy constraint: a further one is a
        # compile, and a heavy one is mostly a one-off whose rows are few.
        threads = 1 if self._heavy(spec) else self.config.fill_threads
        return lambda: llg.compile(spec, threads)

    def _llg(self) -> LlgBackend:
        if self.llg is None:
            raise _no_llguidance()
        return self.llg

    def _matcher(self, compiled: Any) -> Matcher:
        if isinstance(compiled, LlgCompiled):
            if self._spread is None:
                raise _no_llguidance()
            return self._spread.matcher(compiled)
        return xgr.GrammarMatcher(compiled)

    def step(
        self,
        seq_ids: Sequence[int] | np.ndarray,
        tokens: np.ndarray,
        counts: Sequence[int] | np.ndarray,
        *,
        jump_forward: bool = False,
        out: np.ndarray | None = None,
        drafts: np.ndarray | None = None,
        draft_counts: Sequence[int] | np.ndarray | None = None,
        draft_out: np.ndarray | None = None,
    ) -> StepResult:
        """Accept each row's new tokens, then fill the mask of each row's next token (and of its drafts').

        The order matters; each phase reads what the ones before it left
        (phases 1-2: :meth:`_plan_rows`, 4: :meth:`_close_rows`, 6: :meth:`_jump`):

        1. Per row: accept the tokens (:meth:`GrammarSequence.accept`, its
           policies in their order: thinking, the matcher, closing, the value
           checks, which may drop a value that breaks the schema and roll the
           matcher back: :mod:`grammar_backend.sequences`); then the thinking
           section's plan (:meth:`~GrammarSequence.reason`) or the closer's
           (:meth:`~GrammarSequence.plan`: forced, calm or free). A row that
           fails here is an error row and does no more.
        2. Per row, what the answer says: terminated; dropped and hold
           (value checks); a ban of the retried value's token (none under a
           forced token: the closer's plan wins); the close state. A forcing
           row's mask will be its one token, a calm row's is restricted after
           the fill; jump-forward is asked of every other row with the option
           on and no ban (a forced text spelled with the banned token would
           bring the value back).
        3. The batched fill of every row's matcher (one call to the backend).
           From ``pipeline_rows`` rows on, the first rows' fill begins on a
           thread of its own as soon as they are planned, while this thread
           plans the rest (:mod:`grammar_service.fill_pipeline`); this thread
           fills the rest once it is done.
        4. Forced rows: one bit. Calm rows: the completion's next token is
           rechecked against the filled mask, then the row restricted to
           tokens that open nothing (JSON kinds, structural tags) or screened
           token by token (:meth:`GrammarSequence.screen`).
        5. Bans (thinking rows' masks, value retries) and-ed into the rows.
        6. Jump-forward: each asking row's forced tokens, and how many of an
           output's first forced tokens stream at once.
        7. Drafts (speculative decoding, :meth:`_drafts`): each row's draft
           tokens, one position at a time, on a fork of the row's sequence
           (:meth:`GrammarSequence.fork`), each position's mask made as in
           phases 1-5; then the matcher is rolled back.  The drafts are never
           kept: the tokens the target accepts come back as the next step's
           ``tokens``, so a row's state is always that of the tokens accepted.

        Parameters
        ----------
        seq_ids : array of uint64, shape [B]
        tokens : int32 array, shape [B, K]
            Row i's first ``counts[i]`` entries are the tokens generated since
            its previous step (none on its first step).
        counts : int array, shape [B]
        jump_forward : bool
            Also return the forced continuation tokens of each row whose
            sequence has the ``jump_forward`` option on.
        out : numpy.ndarray, optional
            int32 ``[B, ceil(V/32)]``, C-contiguous: the masks are written
            there (the caller's mask buffer) instead of the engine's buffer,
            and ``StepResult.bitmask`` is ``out``.
        drafts : int32 array, shape [B, K], optional
            Row i's first ``draft_counts[i]`` entries are draft tokens
            proposed after its new tokens (``K <= max_draft_tokens``); their
            masks are ``StepResult.draft_bitmask``.  A row with drafts gets
            its forced tokens too: a caller that jumps drops the drafts (the
            output is then what it is without them: a sampled token where
            the grammar forces text could spell it otherwise).
        draft_counts : int array, shape [B], optional
            With ``drafts``.
        draft_out : numpy.ndarray, optional
            int32 ``[K, B, ceil(V/32)]``, C-contiguous: the draft masks are
            written there (the caller's mask buffer, after its ``B`` rows).

        Returns
        -------
        StepResult
            One bad row (unknown id, rejected token, a sequence an earlier
            row named) is reported in ``errors`` and never fails the batch.

        Raises
        ------
        GrammarError
            The batch itself is malformed (shapes, more rows than max_batch), or
            jump-forward is asked of an engine built without ``encode``.
        """
        rows = len(seq_ids)
        jump = self.jump
        if jump_forward and jump is None:
            raise GrammarError("step: jump-forward needs the tokenizer's encoder (GrammarEngine(encode=...))")
        if rows > self.config.max_batch:
            raise GrammarError(f"step: batch of {rows} rows exceeds max_batch {self.config.max_batch}")
        if len(counts) != rows or (rows and (tokens.ndim != 2 or tokens.shape[0] != rows)):
            raise GrammarError(
                f"step: SEQUENCE_ID has {rows} rows, TOKEN_COUNT {len(counts)}, TOKENS shape {tokens.shape}"
            )
        draft_width = self._check_drafts(rows, drafts, draft_counts, draft_out)
        self.table.evict_idle()
        for per_row in (self._terminated, self._closing, self._dropped, self._hold, self._forced_safe):
            per_row[:rows].fill(0)
        self._ban_rows.clear()
        self._forced_rows.clear()
        self._calm_rows.clear()
        self._draft_seqs.clear()
        # Python ints from here on: the per-row work (matcher, value scanner, closer) iterates a row's
        # tokens several times, and a NumPy scalar costs each read and int() more than a Python int.
        id_list: list[int] = seq_ids.tolist() if isinstance(seq_ids, np.ndarray) else [int(s) for s in seq_ids]
        count_list: list[int] = counts.tolist() if isinstance(counts, np.ndarray) else [int(c) for c in counts]
        token_rows: list[list[int]] = tokens.tolist() if rows else []
        draft_list: list[int] | None = None
        if draft_counts is not None:
            draft_list = draft_counts.tolist() if isinstance(draft_counts, np.ndarray) else [int(c) for c in draft_counts]
        errors = _RowErrors(id_list)
        jump_rows: list[tuple[int, GrammarSequence]] | None = [] if jump_forward else None
        pipeline = self._pipeline
        if pipeline is not None and rows >= self.config.pipeline_rows:
            split = self._split(rows)
        else:
            pipeline, split = None, rows
        bitmask = self.bitmask.prepare(rows, out)
        t0 = time.perf_counter()
        try:
            matchers = self._plan_rows(id_list, count_list, token_rows, tokens.shape[1] if rows else 0, jump_rows,
                                       errors, draft_list, draft_width, split)
        finally:
            if pipeline is not None:
                t1 = time.perf_counter()
                head_s = pipeline.wait()  # before anything else writes the rows, an error included
        if pipeline is None:
            self.bitmask.fill_rows(matchers, 0)
        else:
            t2 = time.perf_counter()
            self.bitmask.fill_rows(matchers[split:], split)
            self._record_split(rows, t1 - t0, head_s + time.perf_counter() - t2)
        self._close_rows(bitmask, errors, self._forced_rows, self._calm_rows, self._closing)
        self._ban(bitmask, self._ban_rows)
        forced = self._jump(jump, jump_rows, rows, errors) if jump_rows and jump is not None else self._no_forced[:rows]
        draft_bitmask = draft_valid = draft_closing = None
        if drafts is not None and draft_list is not None:
            draft_bitmask, draft_valid, draft_closing = self._drafts(bitmask, drafts.tolist(), draft_list,
                                                                     draft_width, rows, errors, draft_out)
        return StepResult(
            bitmask=bitmask,
            terminated=self._terminated[:rows],
            errors=self._no_errors[:rows] if errors.found is None else tuple(errors.found),
            forced=forced,
            closing=self._closing[:rows],
            dropped=self._dropped[:rows],
            hold=self._hold[:rows],
            forced_safe=self._forced_safe[:rows],
            draft_bitmask=draft_bitmask,
            draft_valid=draft_valid,
            draft_closing=draft_closing,
        )

    def _split(self, rows: int) -> int:
        """How many of a pipelined step's first rows the fill thread takes: about as many as it fills while the
        step thread plans the rest (``head * fill = (rows - head) * plan``, per row, from the last pipelined
        steps), a third before any; at least an eighth, at most half."""
        plan, fill = self._plan_row_s, self._fill_row_s
        share = plan / (plan + fill) if plan > 0 and fill > 0 else 1 / 3
        return min(rows // 2, max(rows // 8, round(rows * share)))

    def _record_split(self, rows: int, plan_s: float, fill_s: float) -> None:
        """A pipelined step's planning and fill seconds, per row, into the moving averages :meth:`_split` reads."""
        if self._fill_row_s == 0.0:
            self._plan_row_s, self._fill_row_s = plan_s / rows, fill_s / rows
            return
        self._plan_row_s += _SPLIT_WEIGHT * (plan_s / rows - self._plan_row_s)
        self._fill_row_s += _SPLIT_WEIGHT * (fill_s / rows - self._fill_row_s)

    def _check_drafts(self, rows: int, drafts: np.ndarray | None, draft_counts: Sequence[int] | np.ndarray | None,
                      draft_out: np.ndarray | None) -> int:
        """The drafts' width K (0: none), once their shapes (and their mask buffer's) are checked.

        Raises
        ------
        GrammarError
            One of ``drafts`` and ``draft_counts`` without the other, a shape
            that is not ``[B, K]`` and ``[B]``, K over ``max_draft_tokens``, or a
            ``draft_out`` that is not a C-contiguous int32 ``[K, B, W]``.
        """
        if drafts is None and draft_counts is None:
            if draft_out is not None:
                raise GrammarError("step: a draft mask buffer without drafts")
            return 0
        if drafts is None or draft_counts is None:
            raise GrammarError("step: DRAFT_TOKENS and DRAFT_COUNT come together")
        if drafts.ndim != 2 or drafts.shape[0] != rows or len(draft_counts) != rows:
            raise GrammarError(f"step: SEQUENCE_ID has {rows} rows, DRAFT_COUNT {len(draft_counts)}, "
                               f"DRAFT_TOKENS shape {drafts.shape}")
        width = int(drafts.shape[1])
        if width > self.config.max_draft_tokens:
            raise GrammarError(f"step: DRAFT_TOKENS has {width} columns, more than max_draft_tokens "
                               f"{self.config.max_draft_tokens}")
        shape = (width, rows, self.bitmask.width)
        if draft_out is not None and (draft_out.shape != shape or draft_out.dtype != np.int32
                                      or not draft_out.flags.c_contiguous):
            raise GrammarError(f"step: a draft mask buffer must be C-contiguous int32 of shape {shape}, "
                               f"not {draft_out.dtype} {draft_out.shape}")
        return width

    def _plan_rows(self, id_list: list[int], count_list: list[int], token_rows: list[list[int]], width: int,
                   jump_rows: list[tuple[int, GrammarSequence]] | None, errors: _RowErrors,
                   draft_list: list[int] | None = None, draft_width: int = 0,
                   split: int | None = None) -> list[Matcher | None]:
        """:meth:`step`'s phases 1 and 2: each row's accept and plan, and what its answer says.

        Returns the matcher of each row the fill is for (None: the fill leaves it all ones: an error,
        terminated or forced row, or a thinking row, whose mask is its own).  The rows with drafts that
        :meth:`_drafts` steps on are left in ``_draft_seqs``.  Rows ``0..split`` (a row count below the
        batch's) go to the fill thread once planned (:class:`FillPipeline`), before the next row is.
        """
        terminated, closing, dropped, hold = self._terminated, self._closing, self._dropped, self._hold
        ban_rows, forced_rows, calm_rows = self._ban_rows, self._forced_rows, self._calm_rows
        matchers: list[Matcher | None] = [None] * len(id_list)
        pipeline = self._pipeline
        for i, seq in enumerate(self.table.get_rows(id_list)):
            if i == split and pipeline is not None:
                pipeline.submit(matchers[:i], 0)
            count = count_list[i]
            try:
                if not 0 <= count <= width:
                    raise SequenceError(id_list[i], f"TOKEN_COUNT {count} outside 0..{width}")
                drafting = draft_list[i] if draft_list is not None else 0
                if not 0 <= drafting <= draft_width:
                    raise SequenceError(id_list[i], f"DRAFT_COUNT {drafting} outside 0..{draft_width}")
                if isinstance(seq, SequenceError):
                    raise seq
                if count > 1 and (seq.closes or seq.thinking is not None):
                    seq.accept_each(token_rows[i][:count], self.closer, self._stop_token)
                elif count:
                    seq.accept(token_rows[i][:count])
                seq.steps += 1
                done = seq.terminated
                closes = seq.closes
                if seq.thinking is not None:
                    token = seq.reason(self.closer)
                else:
                    token = seq.plan(self.closer, self._stop_token) if closes and not done else FREE
            except (SequenceError, MatcherFailed) as err:
                errors.add(i, err)
                continue
            if drafting and not done and not (count and seq.dropped):
                # A row whose value check dropped tokens is fed again from before them: its drafts are moot.
                self._draft_seqs.append((i, seq))
            if seq.thinking is not None:
                # The thinking section: free but for the stop, special and overrunning tokens, or the
                # end marker forced token by token; no jump, value check or closing before the answer.
                closing[i] = seq.reasoning_state
                if token != FREE:
                    forced_rows.append((i, token))
                else:
                    ban_rows.append((i, seq.thinking_row()))
                continue
            if done:
                terminated[i] = True
                continue
            scanner = seq.values.scanner if seq.values is not None else None
            if count and seq.dropped:
                dropped[i] = seq.dropped
            banned = False
            if scanner is not None:
                hold[i] = scanner.hold()
                # A forced token is the closer's (the stop after a completion, say): no ban undoes it.
                keep = scanner.bans.get(seq.tokens_accepted) if scanner.bans and not seq.forcing else None
                if keep is not None:
                    ban_rows.append((i, keep))
                    banned = True  # forced text may be spelled with a banned token: no jump here
            if closes:
                closing[i] = seq.close_state
                if seq.forcing:
                    forced_rows.append((i, token))
                    continue  # its row is all ones after the fill, then one bit below
                if token != FREE:
                    calm_rows.append((i, token, seq))
            if jump_rows is not None and seq.spec.options.jump_forward and not banned:
                # A calm row (near its budget) jumps too: forced text is part of
                # every completion, so appending it cannot grow what is still
                # open; a forcing row (above) follows its plan token by token.
                jump_rows.append((i, seq))
            matchers[i] = seq.matcher
        return matchers

    def _close_rows(self, bitmask: np.ndarray, errors: _RowErrors, forced_rows: list[tuple[int, int]],
                    calm_rows: list[tuple[int, int, GrammarSequence]], closing: np.ndarray | None) -> None:
        """:meth:`step`'s phase 4: forced rows get their one bit; calm rows are restricted or screened.

        ``bitmask`` is what the last fill wrote; a calm row's new close state goes to ``closing`` (None: a
        draft position's, which no answer reports).
        """
        for i, token in forced_rows:
            self.bitmask.force(i, token)
        for i, token, seq in calm_rows:
            try:
                if not self.bitmask.allows(i, token):
                    # The kept completion no longer starts here (checked between budget checks, not searched).
                    token = seq.recheck(self.closer, self._stop_token)
                    if closing is not None:
                        closing[i] = seq.close_state
                if token == FREE:
                    continue
                if seq.close.calm_ok:
                    self.bitmask.restrict(i, self._calm_row(seq.whole_chars_only, seq.close.openers), token)
                    continue
                allowed = few_allowed(bitmask[i], _SCREEN_MOST)
                if allowed is None:
                    self.bitmask.force(i, token)  # this step only: the next one screens again
                    continue
                self.bitmask.keep(i, seq.screen(self.closer, allowed.tolist(), self._stop_token), token)
            except MatcherFailed as err:
                errors.add(i, err)

    @staticmethod
    def _ban(bitmask: np.ndarray, ban_rows: list[tuple[int, np.ndarray]]) -> None:
        """:meth:`step`'s phase 5: each banned row and-ed with what its bans leave allowed."""
        for i, keep in ban_rows:
            np.bitwise_and(bitmask[i], keep, out=bitmask[i])

    def _drafts(self, bitmask: np.ndarray, drafts: list[list[int]], draft_list: list[int], width: int, rows: int,
                errors: _RowErrors, out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`step`'s phase 7: the masks after each row's drafts, position by position, one batched fill each.

        Each row in ``_draft_seqs`` goes on a fork of its sequence: a draft the mask before it allows is
        accepted there (thinking, matcher, closing; no value check, see :meth:`GrammarSequence.fork`),
        then the position is planned and its mask made as phases 2-5 make a row's: the thinking row or its
        forced marker, the closer's forced token or calm restriction.  No value check bans a token past the
        row's position (a backtrack drops the bans after where it goes back to), so none applies to a draft's.
        A row stops drafting at a draft its mask forbids (the target cannot accept it), after a stop token,
        or where its matcher fails (that row's error).  Every fork's matcher tokens are rolled back at the end.
        Each position a draft reaches reports its close state (``draft_closing``), as phase 2 reports a row's.
        """
        if out is not None:
            masks = out
        else:
            if self._draft_masks.shape[0] < width:
                self._draft_masks = np.full((width, self.config.max_batch, self.bitmask.width), -1, dtype=np.int32)
            # Each position's rows are one block: the batched fill writes a contiguous [B, W].
            masks = self._draft_masks[:width].reshape(-1)[: width * rows * self.bitmask.width].reshape(
                width, rows, self.bitmask.width)
        valid = self._draft_valid[:rows]
        valid.fill(0)
        if self._draft_closing.shape[1] < width:
            self._draft_closing = np.zeros((self.config.max_batch, width), dtype=np.int8)
        closing = self._draft_closing[:rows, :width]
        closing.fill(0)
        live = [(i, seq, seq.fork()) for i, seq in self._draft_seqs]
        forks = {i: fork for i, _, fork in live}
        vocab = self.vocab_size
        try:
            for j in range(width):
                before = bitmask if j == 0 else masks[j - 1]
                matchers: list[Matcher | None] = [None] * rows
                forced_rows: list[tuple[int, int]] = []
                calm_rows: list[tuple[int, int, GrammarSequence]] = []
                ban_rows: list[tuple[int, np.ndarray]] = []
                going = []
                for i, seq, fork in live:
                    if valid[i] < j or draft_list[i] <= j:
                        continue
                    token = drafts[i][j]
                    if not 0 <= token < vocab or not (int(before[i, token >> 5]) >> (token & 31)) & 1:
                        continue
                    try:
                        fork.accept((token,))
                        if fork.terminated:
                            continue
                        if fork.thinking is not None:
                            planned = fork.reason(self.closer)
                            if planned != FREE:
                                forced_rows.append((i, planned))
                            else:
                                ban_rows.append((i, fork.thinking_row()))
                        else:
                            planned = fork.plan(self.closer, self._stop_token) if fork.closes else FREE
                            if fork.forcing:
                                forced_rows.append((i, planned))
                            else:
                                if planned != FREE:
                                    calm_rows.append((i, planned, fork))
                                matchers[i] = fork.matcher
                    except SequenceError:
                        continue  # allowed by the mask, refused by a policy (a thinking marker's overrun): stop here
                    except MatcherFailed as err:  # llguidance past a limit: the row's matcher is done for
                        errors.add(i, err)
                        continue
                    going.append(i)
                if not going:
                    masks[j:].fill(ALL_ALLOWED)  # never a stale or all-zero row where no draft reaches
                    break
                filled = self.bitmask.fill(matchers, masks[j])
                self._close_rows(filled, errors, forced_rows, calm_rows, None)
                self._ban(filled, ban_rows)
                for i in going:
                    valid[i] = j + 1
                    fork = forks[i]
                    closing[i, j] = fork.reasoning_state if fork.thinking is not None else \
                        fork.close_state if fork.closes else 0
        finally:
            for i, seq, fork in live:
                if fork.tokens_accepted > seq.tokens_accepted:
                    try:
                        seq.matcher.rollback(fork.tokens_accepted - seq.tokens_accepted)
                    except (RuntimeError, ValueError) as err:
                        errors.add(i, SequenceError(seq.seq_id, f"its drafts could not be rolled back: {err}"))
        return masks, valid, closing

    def _jump(self, jump: JumpForward, jump_rows: list[tuple[int, GrammarSequence]], rows: int,
              errors: _RowErrors) -> tuple[tuple[int, ...], ...]:
        """:meth:`step`'s phase 6: each asking row's forced tokens, and how many of an output's first stream at once."""
        found = list(self._no_forced[:rows])
        for i, seq in jump_rows:
            try:
                found[i] = jump.tokens(seq.matcher)
            except MatcherFailed as err:
                errors.add(i, err)
                continue
            scanner = seq.values.scanner if seq.values is not None else None
            if found[i] and scanner is not None and not scanner.tokens:
                # The output's first forced run (`{"name":`): how much of it streams at once?
                self._forced_safe[i] = scanner.safe_prefix(found[i])
        return tuple(found)

    def rollback(self, seq_ids: Sequence[int], counts: Sequence[int]) -> tuple[SequenceError | None, ...]:
        """Roll each sequence back by its count; per-row errors, never failing the batch."""
        errors: list[SequenceError | None] = []
        for seq_id, count in zip(seq_ids, counts, strict=True):
            try:
                self.table.rollback(int(seq_id), int(count))
                errors.append(None)
            except SequenceError as err:
                errors.append(err)
        return tuple(errors)

    def end(self, seq_ids: Sequence[int]) -> int:
        """Free sequences (unknown ids are ignored); returns how many were active.

        A completed output recorded for ``backend: auto``'s replay is handed to it here.
        """
        ended = 0
        for seq_id in seq_ids:
            seq = self.table.pop(int(seq_id))
            if seq is None:
                continue
            ended += 1
            if seq.recording is not None and seq.terminated:
                self.auto_switch.offer(self._key(seq.spec, XGRAMMAR), seq.spec, seq.recording)
        return ended

    def close(self) -> None:
        """Stop the compile threads and worker processes."""
        self._deadlines.close()
        self.auto_switch.close()
        self.cache.close()
        self.llg_cache.close()
        if self._spread is not None:
            self._spread.close()
        pipeline, self._pipeline = self._pipeline, None  # later steps plan, then fill
        if pipeline is not None:
            pipeline.close()
        self.workers.close()


class _RowErrors:
    """A step's row errors, the list made only when a row fails (most steps have none)."""

    __slots__ = ("found", "ids")

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.found: list[SequenceError | None] | None = None

    def add(self, row: int, err: SequenceError | MatcherFailed) -> None:
        if self.found is None:
            self.found = [None] * len(self.ids)
        self.found[row] = _row_error(self.ids[row], err)


def _also(first: GrammarError, backend: str, err: GrammarError) -> GrammarError:
    """The error of a start that every backend failed, naming each one's reason.

    ``first``'s type and status, unless ``first`` refused the constraint
    (a :class:`CompileError`, final) while ``backend`` only ran out of time
    or queue: then ``err``'s (DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED), since
    a retry may still be served by ``backend``.  Before, a 100k-item enum that
    llguidance refused and xgrammar was still compiling told the client
    INVALID_ARGUMENT, so it never retried (``bench/compile_storm.py --burst``).
    """
    reason = err.reason if isinstance(err, CompileError) else str(err)
    if isinstance(first, CompileError) and not isinstance(err, CompileError):
        combined: GrammarError = type(err)(f"{err} ({_other(backend)}: {first.reason})")
    elif isinstance(first, CompileError):
        combined = CompileError(first.field, f"{first.reason} ({backend} too: {reason})")
    else:
        combined = type(first)(f"{first} ({backend} too: {reason})")
    combined.__cause__ = first
    return combined


def _other(backend: str) -> str:
    return LLGUIDANCE if backend == XGRAMMAR else XGRAMMAR


def _row_error(seq_id: int, err: SequenceError | MatcherFailed) -> SequenceError:
    """A step's row error: a matcher that cannot go on becomes that row's :class:`BackendFailed`."""
    return BackendFailed(seq_id, str(err)) if isinstance(err, MatcherFailed) else err


def _no_llguidance() -> CompileError:
    return CompileError("grammar_options.backend", "llguidance is not available on this server")


def _internal(what: str, err: Exception) -> GrammarError:
    failure = GrammarError(f"grammar: internal error {what}: {err!r}")
    failure.__cause__ = err
    return failure
