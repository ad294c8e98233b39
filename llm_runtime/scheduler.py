"""The in-flight batched decode loop.

One loop thread owns the engine.  Requests join and leave the batch at step
boundaries; constrained and unconstrained requests share one batch.  For decode
step ``t`` the loop

1. launches the grammar step (the tokens sampled at ``t-1`` for every constrained
   row, or an empty list for a row that joins now) through its
   :class:`~llm_runtime.grammar_phase.GrammarPhase` (sent over the grammar
   channel, or on a worker thread for an in-process provider),
2. runs ONE batched forward for the rows already in the engine, plus ONE prefill
   forward for all the rows that join now (left-padded), while the grammar step runs,
3. waits for the mask (the wait AFTER the forward is what the overlap did not
   hide; it is recorded as ``mask_wait_s``), applies it to the constrained rows,
   samples every row, streams the text deltas, and
4. retires finished rows (engine slot freed, ``MaskProvider.end`` called once for
   all of them).

In ``grammar_mode="processor"`` the grammar step runs after the forward
instead (an engine logits processor's call order); everything else is the same.

Jump-forward (request option ``jump_forward``, on by default):
the grammar step also returns the text each row's grammar forces next,
canonically tokenized (:mod:`grammar_backend.jump`).  A row with two or more
forced tokens takes them instead of a sampled token; the next step feeds
them in one forward (:meth:`llm_runtime.engine.TorchEngine.extend`) and the
grammar accepts them in order, so the output is the text token-by-token
decoding was forced to produce, in fewer forwards.

On the CPU engine the grammar step is hidden behind the forward: ``make
bench-e2e`` reports the mask wait that is not (the step stats'
``mask_wait_s``; figures: docs/benchmarks.md).

``MaskProvider.start`` (grammar compile) runs on a pool of start threads; a
request waits outside the batch until its grammar is ready, so a slow compile
never stalls the batch.  A start thread only waits (the compile runs in the
grammar model's worker processes, which bound and queue compiles), so the
pool is large and grows on demand: requests with a cached grammar never wait
behind slow compiles of others.

Events go to the callback given at :meth:`Scheduler.submit`, on the loop thread:
zero or more :class:`TokenEvent` and exactly one last :class:`FinishEvent`.  The
concatenation of every ``TokenEvent.text_delta`` equals ``FinishEvent.text``.
A callback must not block; if it raises, the exception is logged and the
request is cancelled (no further events).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Self

import numpy as np
import torch
from tokenizers import Tokenizer

import contract
from contract.finish import FinishEvent, FinishReason
from grammar_backend.protocol import CLOSE_STATE_REASONS, REASONING_STATES, CloseState
from telemetry import PUBLISH_MIN_GAP_S, LatencyWindow, Snapshot

from .detok import IncrementalDetokenizer, special_token_ids
from .errors import (
    CANCELLED,
    Overloaded,
    RequestError,
    SchedulerClosed,
    config_error,
    status_of,
)
from .grammar_phase import GrammarPhase, JumpPolicy
from .logprobs import TokenLogprobs, forced
from .mask import ROW_DROP, ROW_ERROR, ROW_STOP, ConstraintRequest, MaskProvider, bitmask_width
from .sampler import Sampler, SamplingParams, TokenCounts
from .speculation import PromptLookup

if TYPE_CHECKING:
    # The torch engine (transformers) is not imported at run time: the TensorRT-LLM
    # engine uses this module's request checks inside TensorRT-LLM's environment.
    from .engine import Engine

__all__ = [
    "DEFAULT_PREFILL_TOKENS",
    "SCHEDULER_GRAMMAR_MODES",
    "CheckedRequest",
    "EventCallback",
    "FinishEvent",
    "GenerationRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "TokenEvent",
    "check_request",
    "closed_finish",
]

_log = logging.getLogger(__name__)

#: How the scheduler consumes the grammar side (see ``SchedulerConfig.grammar_mode``).
SCHEDULER_GRAMMAR_MODES: Final = ("overlap", "processor")
#: Upper bound of ``SchedulerConfig.max_jump_tokens``.
MAX_JUMP_TOKENS: Final = 256
#: ``SchedulerConfig.max_prefill_tokens`` when unset, by the engine's device type (see there).
DEFAULT_PREFILL_TOKENS: Final = {"cpu": 256, "cuda": 8192}


def closed_finish(reason: FinishReason, close_state: int, stop_string: bool) -> tuple[FinishReason, str | None]:
    """The finish reason and close reason of an output whose last grammar state was ``close_state``.

    A forced completion ended the output: only a clean stop (its stop token
    sampled) is a successful close; a budget close reports ``"length"``.
    Shared by every engine.
    """
    close_reason = CLOSE_STATE_REASONS.get(close_state) if reason == "stop" and not stop_string else None
    if close_reason == CLOSE_STATE_REASONS[CloseState.BUDGET]:
        return "length", close_reason
    return reason, close_reason


@dataclass(frozen=True)
class SchedulerConfig:
    """Settings of :class:`Scheduler`.

    Attributes
    ----------
    max_batch_size : int or None
        Most sequences per step; ``None`` = the engine's slot count (the maximum).
    max_queued : int
        Most requests held at once (starting + waiting + in the batch); more are
        refused with :class:`llm_runtime.errors.Overloaded`.
    idle_wait_s : float
        How long the idle loop sleeps between checks (submit/cancel wake it at once).
    start_threads : int
        Most threads waiting on ``MaskProvider.start`` at once (created on demand).
    start_wait_s : float
        How long a step may wait for the grammar starts of the constrained
        requests that arrived since the last step (at most half the last
        step's time).  A start with a cached grammar takes well under that
        over the grammar channel; without the wait it ended during the step
        and its request joined the batch one step after an unconstrained one
        would have: a step of time to first token (docs/benchmarks.md, the
        serving path's second round and component costs).  A start that is
        still compiling joins a later step.  0: no wait.
    stats_capacity : int
        Steps kept in the per-step counters (a ring buffer).
    metrics_interval_s : float
        Most seconds between two metric snapshots while requests run (a gauge
        change publishes sooner, once ``telemetry.PUBLISH_MIN_GAP_S``
        has passed since the last one).
    grammar_mode : str
        ``"overlap"`` (default): the grammar step of step ``t`` runs on a worker
        thread while the forward of step ``t`` runs.  ``"processor"``: after the
        forward, serially, as an engine's logits processor would call it (for
        measuring what the overlap saves); the same request and the same
        reading of its answer otherwise (:mod:`llm_runtime.grammar_phase`).
    max_prefill_tokens : int or None
        Most prompt positions one step prefills (None: by the engine's
        device, :data:`DEFAULT_PREFILL_TOKENS`; :attr:`Scheduler.config`
        holds the value in force).  Ready requests join the
        batch oldest first while their count times the longest prompt among
        them (the prompts are left-padded into one forward,
        :meth:`~llm_runtime.engine.TorchEngine.prefill_batch`) stays within
        it; a step's first prompt always joins, and one longer than the bound
        joins alone and runs in chunks of at most this many tokens, one per
        step, each next to the decode forward of the other rows
        (:meth:`~llm_runtime.engine.TorchEngine.prefill_chunk`).  On a CPU a
        prefill costs the same per token at any batch size, so a larger group
        only makes each of its requests wait for all of them, and every
        decoding stream for the whole forward (docs/benchmarks.md, the fourth
        round and chunked prefill).  The CPU default is sized for the 2-core
        host: a long prompt holds the decoding streams for one chunk between
        two of their tokens, not for its whole prefill.  ``make loadtest
        LOADTEST_TIME=180s`` (MaskBench prompts of up to about 1,000 tokens):
        inter-token p99 490-630 ms at 256 against 950-1,200 ms at 1,024, with
        time to first token p50 within the runs' spread.  A GPU takes
        several thousand (8,192, as TensorRT-LLM's default ``max_num_tokens``).
    max_jump_tokens : int
        Most forced tokens a row appends in one step (jump-forward; 0: off
        for every request).  Bounds the extra width of that step's forward.
    jump_min_fill : float
        The next forward is right-padded to its widest jump, so every row
        pays for it.  Until the engine's cost of a wider forward is measured
        (:class:`~llm_runtime.grammar_phase.JumpPolicy`), a forward ``K``
        wide is taken to cost ``1 + jump_min_fill * (K - 1)`` times a
        one-token one: a step's jumps are cut to the width that adds the
        most tokens per unit of cost, and dropped when a plain step does
        better (those rows sample under the mask instead).  On the 2-core
        CPU host one row jumping 8 tokens in a batch of 8 was about
        break-even (fill 0.125), and jumps without this rule left
        constrained throughput below free at 16 rows (docs/benchmarks.md,
        jump-forward, and constrained vs unconstrained with jump-forward).
        0: jumps assumed free until measured.
    draft_tokens : int
        Prompt-lookup speculation (:mod:`llm_runtime.speculation`) for
        requests that do not set ``draft_tokens``: the most draft tokens a row
        feeds per step, copied from earlier in its sequence; 0 (the default):
        off.  Each step's forward is as wide as its widest row of drafts,
        which every row pays for, so it pays where outputs copy from their
        input (``bench/speculation_bench.py``; docs/benchmarks.md).  In
        ``0..contract.MAX_DRAFT_TOKENS``.
    """

    max_batch_size: int | None = None
    max_queued: int = 1024
    idle_wait_s: float = 0.05
    start_threads: int = 64
    start_wait_s: float = 0.005
    stats_capacity: int = 65536
    grammar_mode: str = "overlap"
    metrics_interval_s: float = 1.0
    max_prefill_tokens: int | None = None
    max_jump_tokens: int = 16
    jump_min_fill: float = 0.25
    draft_tokens: int = 0

    def __post_init__(self) -> None:
        def positive_int(name: str, value: object) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise config_error(f"scheduler.{name}", f"must be a positive integer, got {value!r}")

        if self.max_batch_size is not None:
            positive_int("max_batch_size", self.max_batch_size)
        for name in ("max_queued", "start_threads", "stats_capacity"):
            positive_int(name, getattr(self, name))
        if self.max_prefill_tokens is not None:
            positive_int("max_prefill_tokens", self.max_prefill_tokens)
        j = self.max_jump_tokens
        if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j <= MAX_JUMP_TOKENS:
            raise config_error("scheduler.max_jump_tokens", f"must be an integer in 0..{MAX_JUMP_TOKENS}, got {j!r}")
        d = self.draft_tokens
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= contract.MAX_DRAFT_TOKENS:
            raise config_error("scheduler.draft_tokens",
                               f"must be an integer in 0..{contract.MAX_DRAFT_TOKENS}, got {d!r}")
        f = self.jump_min_fill
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise config_error("scheduler.jump_min_fill", f"must be a number in [0, 1], got {f!r}")
        if self.grammar_mode not in SCHEDULER_GRAMMAR_MODES:
            raise config_error("scheduler.grammar_mode",
                               f"must be one of {', '.join(SCHEDULER_GRAMMAR_MODES)}, got {self.grammar_mode!r}")
        m = self.metrics_interval_s
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 60:
            raise config_error("scheduler.metrics_interval_s", f"must be in (0, 60] seconds, got {m!r}")
        wait = self.idle_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait <= 10:
            raise config_error("scheduler.idle_wait_s", f"must be in (0, 10] seconds, got {wait!r}")
        sw = self.start_wait_s
        if isinstance(sw, bool) or not isinstance(sw, (int, float)) or not 0 <= sw <= 1:
            raise config_error("scheduler.start_wait_s", f"must be in [0, 1] seconds, got {sw!r}")


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request.

    Attributes
    ----------
    prompt_token_ids : sequence of int
        The tokenized prompt (chat template already applied).
    request_id : str or None
        Caller's id (must not be in flight); ``None`` = the scheduler assigns one.
    constraint : ConstraintRequest or None
        Forwarded to the :class:`~llm_runtime.mask.MaskProvider`; ``None`` = free text.
    max_tokens : int
        Most tokens to generate (the end token counts).
    temperature, top_k, top_p, seed, repetition_penalty, frequency_penalty, presence_penalty, min_p
        See :class:`llm_runtime.sampler.SamplingParams` (``seed`` None: one is
        drawn, and :attr:`FinishEvent.seed` reports it).
    stop : tuple of str
        Stop strings; the output ends right before the first one.
    logprobs : int or None
        Report each output token's log probability and this many alternatives
        (:func:`contract.check_logprobs`) in :attr:`TokenEvent.logprobs`; None: off.
    draft_tokens : int or None
        Prompt-lookup speculation for this request: the most draft tokens it
        feeds per step (0: off; :func:`contract.check_draft_tokens`); None:
        the scheduler's ``draft_tokens``.  Greedy outputs are the same with
        and without; a seeded sampled output too, but for floating-point
        differences between a wide forward and one-token ones.  A request
        with a repetition, frequency or presence penalty or with log
        probabilities does not draft (refused where it asks for drafts).
    """

    prompt_token_ids: Sequence[int]
    request_id: str | None = None
    constraint: ConstraintRequest | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logprobs: int | None = None
    draft_tokens: int | None = None


@dataclass(frozen=True)
class TokenEvent:
    """Text streamed for a request.

    ``token_ids`` are the tokens sampled for it (empty when the event only
    flushes held-back text); ``text_delta`` may be empty.  ``logprobs``
    (a request that asked for them; None otherwise): one entry per token of
    ``token_ids``, in order.  The text of a token the detokenizer holds back
    (part of a character, or of what may be a stop string) comes in a later
    event than its entry.
    """

    text_delta: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None


EventCallback = Callable[[TokenEvent | FinishEvent], None]


@dataclass(frozen=True)
class SchedulerStats:
    """Counters for benchmarking (the last ``stats_capacity`` steps, oldest first).

    Attributes
    ----------
    steps : int
        Steps run since the last reset.
    step_s : np.ndarray
        float64 seconds of the whole step (grammar request, forward, masking,
        sampling, streaming the tokens).
    forward_s : np.ndarray
        float64 seconds of the step's forward work (batched decode + prefills).
    mask_wait_s : np.ndarray
        float64 seconds the loop waited for the mask AFTER its forward finished
        (0 when the grammar step was hidden, NaN when no row was constrained).
    grammar_s : np.ndarray
        float64 seconds ``MaskProvider.step`` took (NaN: no row constrained).
    grammar_service_s : np.ndarray
        float64 seconds of it the grammar side reported as its own work (NaN:
        not reported); ``grammar_s`` minus this is the call's transport.
    grammar_loop_s : np.ndarray
        float64 seconds of the loop's own time on the step's grammar work,
        outside the forward: sending the request, waiting for and reading the
        answer, masking (:attr:`GrammarPhase.loop_s`; NaN: no row constrained).
        What a constrained step adds to a free one of the same rows, besides
        the forward's jumped tokens.
    batch_size, constrained_rows, prefill_rows : np.ndarray
        int32 rows per step (``prefill_rows``: the rows whose prompt ran in
        the step, a chunk of one counting as one).
    output_tokens, jump_tokens : np.ndarray
        int32 tokens the step added to outputs, and how many of them were
        forced by jump-forward (not sampled).
    draft_tokens, kept_drafts : np.ndarray
        int32 draft tokens the step's forward fed (prompt-lookup
        speculation), and how many of them the rows kept (part of
        ``output_tokens``).
    max_batch_size_seen : int
        Largest batch since the last reset.
    end_errors : int
        ``MaskProvider.end`` calls that raised (logged).
    """

    steps: int
    step_s: np.ndarray
    forward_s: np.ndarray
    mask_wait_s: np.ndarray
    grammar_s: np.ndarray
    grammar_service_s: np.ndarray
    grammar_loop_s: np.ndarray
    batch_size: np.ndarray
    constrained_rows: np.ndarray
    prefill_rows: np.ndarray
    output_tokens: np.ndarray
    jump_tokens: np.ndarray
    draft_tokens: np.ndarray
    kept_drafts: np.ndarray
    max_batch_size_seen: int
    end_errors: int


class _Stats:
    """Ring buffers written by the loop thread, read under a lock."""

    def __init__(self, capacity: int) -> None:
        self.lock = threading.Lock()
        self.capacity = capacity
        self.step = np.zeros(capacity)
        self.forward = np.zeros(capacity)
        self.mask_wait = np.zeros(capacity)
        self.grammar = np.zeros(capacity)
        self.service = np.zeros(capacity)
        self.loop = np.zeros(capacity)
        self.batch = np.zeros(capacity, dtype=np.int32)
        self.constrained = np.zeros(capacity, dtype=np.int32)
        self.prefill = np.zeros(capacity, dtype=np.int32)
        self.outputs = np.zeros(capacity, dtype=np.int32)
        self.jumps = np.zeros(capacity, dtype=np.int32)
        self.drafts = np.zeros(capacity, dtype=np.int32)
        self.kept = np.zeros(capacity, dtype=np.int32)
        self.steps = 0
        self.max_batch = 0
        self.end_errors = 0

    def record(self, step: float, fwd: float, phase: GrammarPhase | None, batch: int, constrained: int,
               prefill: int, outputs: int, jumps: int, drafts: int, kept: int) -> None:
        with self.lock:
            i = self.steps % self.capacity
            self.step[i] = step
            self.forward[i] = fwd
            nan = math.nan
            self.mask_wait[i] = nan if phase is None else phase.wait_s
            self.grammar[i] = nan if phase is None else phase.call_s
            self.service[i] = nan if phase is None else phase.grammar_s
            self.loop[i] = nan if phase is None else phase.loop_s
            self.batch[i] = batch
            self.constrained[i] = constrained
            self.prefill[i] = prefill
            self.outputs[i] = outputs
            self.jumps[i] = jumps
            self.drafts[i] = drafts
            self.kept[i] = kept
            self.steps += 1
            self.max_batch = max(self.max_batch, batch)

    def snapshot(self) -> SchedulerStats:
        with self.lock:
            n = min(self.steps, self.capacity)
            start = self.steps % self.capacity if self.steps > self.capacity else 0
            order = (np.arange(n) + start) % self.capacity
            return SchedulerStats(
                steps=self.steps,
                step_s=self.step[order].copy(),
                forward_s=self.forward[order].copy(),
                mask_wait_s=self.mask_wait[order].copy(),
                grammar_s=self.grammar[order].copy(),
                grammar_service_s=self.service[order].copy(),
                grammar_loop_s=self.loop[order].copy(),
                batch_size=self.batch[order].copy(),
                constrained_rows=self.constrained[order].copy(),
                prefill_rows=self.prefill[order].copy(),
                output_tokens=self.outputs[order].copy(),
                jump_tokens=self.jumps[order].copy(),
                draft_tokens=self.drafts[order].copy(),
                kept_drafts=self.kept[order].copy(),
                max_batch_size_seen=self.max_batch,
                end_errors=self.end_errors,
            )

    def reset(self) -> None:
        with self.lock:
            self.steps = 0
            self.max_batch = 0
            self.end_errors = 0


@dataclass(eq=False)
class _Seq:
    """Loop-side state of one request."""

    rid: str
    seq_id: int
    prompt: np.ndarray
    constraint: ConstraintRequest | None
    max_tokens: int
    params: SamplingParams
    stop: tuple[str, ...]
    callback: EventCallback
    gen: torch.Generator
    detok: IncrementalDetokenizer
    counts: TokenCounts | None = None  # the output's token counts, for a request with a penalty
    started: bool = False  # MaskProvider.start returned
    backend: str | None = None  # what MaskProvider.start returned
    ended: bool = False  # MaskProvider.end issued
    in_engine: bool = False
    prefilled: int = 0  # prompt tokens cached by its chunks so far (a prompt longer than max_prefill_tokens)
    finished: bool = False
    generated: int = 0
    last_token: int = -1
    jump: tuple[int, ...] = ()  # forced tokens appended at the last step: the next step feeds them
    jump_safe: int = 0  # how many of the first of them no value check can drop (they stream at once)
    safe_token: int = -1  # a forced token that streams as soon as it is sampled (-1: none; see _apply_grammar)
    close_state: int = CloseState.OPEN  # the grammar side's CLOSING of the last step
    # Value checks (grammar_backend.values; JSON-constrained rows):
    out: list[int] | None = None  # the generated tokens
    committed: int = 0  # how many of them are streamed (pushed to the detokenizer)
    held: int = 0  # how many accepted ones the grammar side may still drop (its HOLD of the last step)
    refeed: bool = False  # tokens were dropped: the next step feeds last_token again and accepts nothing
    retries: int = 0  # times tokens were dropped
    dropped: int = 0  # tokens dropped in all
    # A thinking section (contract.reasoning; the grammar side tracks it and says so in CLOSING):
    reasoning_tokens: int | None = None  # tokens sampled inside it (None: never in one)
    reasoning_cut: bool = False  # its end marker was forced
    # Log probabilities (request field logprobs; None: not asked): the entries of the output's tokens not
    # streamed yet, aligned with them (with out[committed:] where value checks hold tokens back).
    lps: list[TokenLogprobs] | None = None
    # Prompt-lookup speculation (None: off for this request): the sequence's tokens and their n-grams.
    lookup: PromptLookup | None = None
    spec: int = 0  # most draft tokens a step
    drafts: tuple[int, ...] = ()  # fed after last_token in this step's forward
    accepted: tuple[int, ...] = ()  # drafts the target kept at the last step: the grammar gets them before last_token


@dataclass(slots=True)
class _Walk:
    """One drafting row's verification (:meth:`Scheduler._verify`)."""

    row: int  # in the step's batch
    col: int  # in the grammar answer (-1: a free row)
    limit: int  # drafts it may keep (the grammar holds them)
    last: int  # the token sampled at its current position
    closes: list[int]  # the close state of each position sampled so far
    kept: int = 0


@dataclass(frozen=True)
class CheckedRequest:
    """A :class:`GenerationRequest` that passed :func:`check_request`."""

    prompt: np.ndarray
    params: SamplingParams
    stop: tuple[str, ...]
    constraint: ConstraintRequest | None  # with the request's budget
    draft_tokens: int | None  # None: the engine's default


def check_request(
    req: GenerationRequest, callback: EventCallback, cfg: SchedulerConfig, *, vocab_size: int, context_len: int
) -> CheckedRequest:
    """Check a request against the limits of ``cfg`` and the engine (shared by every engine).

    Raises
    ------
    RequestError
        Naming the field at fault.
    """
    if not isinstance(req, GenerationRequest):
        raise RequestError("request", f"must be a GenerationRequest, got {type(req).__name__}")
    if not callable(callback):
        raise RequestError("callback", "must be callable")
    if req.request_id is not None and (not isinstance(req.request_id, str) or not req.request_id):
        raise RequestError("request_id", "must be a non-empty string or None")
    try:
        prompt = np.asarray(req.prompt_token_ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError) as err:
        raise RequestError("prompt_token_ids", f"must be a sequence of integers: {err}") from err
    n = int(prompt.shape[0])
    if n == 0:
        raise RequestError("prompt_token_ids", "must not be empty")
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= vocab_size:
        raise RequestError("prompt_token_ids", f"ids must be in [0, {vocab_size}), got [{lo}, {hi}]")
    mt = req.max_tokens
    # No cap of its own: the serving bound is preprocessing's max_tokens_limit (one value, rendered
    # from MAX_TOKENS_LIMIT); here only the engine's context bounds it.
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise RequestError("max_tokens", f"must be a positive integer, got {mt!r}")
    if n + mt > context_len:
        raise RequestError(
            "max_tokens", f"prompt ({n} tokens) + max_tokens ({mt}) exceed the context length {context_len}"
        )
    if req.constraint is not None and not isinstance(req.constraint, ConstraintRequest):
        raise RequestError("constraint", f"must be a ConstraintRequest or None, got {type(req.constraint).__name__}")
    stop = tuple(req.stop)
    try:
        # The contract's ranges, as preprocessing (the served path's authority) applies them.
        contract.check_sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                                stop=stop, repetition_penalty=req.repetition_penalty,
                                frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                                min_p=req.min_p)
        logprobs = contract.check_logprobs(req.logprobs)
        drafts = contract.check_draft_tokens(req.draft_tokens, penalties={name: getattr(req, name)
                                                                          for name in contract.PENALTY_FIELDS},
                                             logprobs=logprobs)
    except contract.ContractError as err:
        raise RequestError(err.field, err.reason) from err
    # Unseeded is random, and the seed drawn is reported (FinishEvent.seed) so the output can be replayed.
    seed = secrets.randbelow(contract.SEED_LIMIT) if req.seed is None else req.seed
    params = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed,
                            repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
                            presence_penalty=req.presence_penalty, min_p=req.min_p, logprobs=logprobs)
    # The budget rides with the constraint: the grammar side closes the output before it runs out.
    constraint = None if req.constraint is None else dataclasses.replace(req.constraint, budget=mt)
    return CheckedRequest(prompt, params, stop, constraint, drafts)


class Scheduler:
    """In-flight batched decoding over an engine and a mask provider.

    Parameters
    ----------
    engine : Engine
        e.g. :class:`llm_runtime.engine.TorchEngine`; driven only by the loop thread.
    mask_provider : MaskProvider
        The grammar side.
    config : SchedulerConfig
        Limits and knobs.
    on_metrics : callable, optional
        Receives a :class:`telemetry.Snapshot` of the ``llm``
        metrics on the loop thread, when a gauge changed (at most once per
        ``telemetry.PUBLISH_MIN_GAP_S``) or every
        ``metrics_interval_s`` while requests run.

    Raises
    ------
    grammar_backend.errors.ConfigError
        If ``config.max_batch_size`` exceeds the engine's slots.
    """

    def __init__(self, engine: Engine, mask_provider: MaskProvider, config: SchedulerConfig | None = None,
                 on_metrics: Callable[[Snapshot], None] | None = None) -> None:
        cfg = config if config is not None else SchedulerConfig()
        if cfg.max_batch_size is not None and cfg.max_batch_size > engine.max_batch_size:
            raise config_error(
                "scheduler.max_batch_size",
                f"{cfg.max_batch_size} exceeds the engine's {engine.max_batch_size} cache slots",
            )
        budget = cfg.max_prefill_tokens
        if budget is None:
            budget = DEFAULT_PREFILL_TOKENS[engine.device.type]
            cfg = dataclasses.replace(cfg, max_prefill_tokens=budget)
        self._cfg = cfg
        self._prefill_budget = budget
        self._engine = engine
        self._provider = mask_provider
        self._max_batch = cfg.max_batch_size if cfg.max_batch_size is not None else engine.max_batch_size
        self._vocab = engine.vocab_size
        self._eos = engine.eos_token_ids
        tok = engine.tokenizer
        self._tokenizer = tok
        self._special = special_token_ids(tok)
        limit = min(self._vocab, tok.get_vocab_size(with_added_tokens=True))
        self._sampler = Sampler(self._vocab, token_limit=limit, device=engine.device)
        self._device = engine.device

        b, w = self._max_batch, bitmask_width(self._vocab)
        # Reused per-step buffers: the batch's bitmask rows and logits (the
        # grammar request's own live in the phase).
        # On a GPU the host rows are pinned and copied without blocking into
        # one device buffer: an unpinned ``.to(device)`` allocated and synced
        # every constrained step.  The copy is done before the host rows are
        # written again: sampling reads its tokens back to the host first.
        cuda = self._device.type == "cuda"
        self._bitmask_host = torch.full((b, w), -1, dtype=torch.int32, pin_memory=cuda)
        self._bitmask_np = self._bitmask_host.numpy()
        self._bitmask_dev = torch.empty((b, w), dtype=torch.int32, device=self._device) if cuda else None
        self._logits = torch.empty((b, self._vocab), dtype=torch.float32, device=self._device)
        self._phase = GrammarPhase(mask_provider, max_rows=b, max_jump_tokens=cfg.max_jump_tokens,
                                   max_draft_tokens=contract.MAX_DRAFT_TOKENS, overlap=cfg.grammar_mode == "overlap")
        # What wider forwards cost, measured apart for steps with constrained rows (the grammar's work
        # grows with the width too) and steps without: each step's jumps and drafts are weighed on its own.
        self._jumps = JumpPolicy(cfg.jump_min_fill)
        self._free_widths = JumpPolicy(cfg.jump_min_fill)

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._inbox: deque[_Seq] = deque()
        self._cancels: list[str] = []
        self._started_q: deque[tuple[_Seq, BaseException | None]] = deque()
        self._live: dict[str, _Seq] = {}  # every request not yet finished (guarded by _lock)
        self._closing = False

        self._starting: dict[str, _Seq] = {}
        self._fresh: set[str] = set()  # starts submitted at the last boundary, not yet returned (guarded by _lock)
        self._last_step_s = 0.0
        self._ready: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._logprobs = False  # a row of the batch reports log probabilities (updated as the batch changes)
        self._stats = _Stats(cfg.stats_capacity)
        self._on_metrics = on_metrics
        self._lat_step = LatencyWindow()
        self._lat_grammar = LatencyWindow()
        self._lat_wait = LatencyWindow()
        self._lat_loop = LatencyWindow()
        self._steps_total = 0
        self._drafts_total = 0  # prompt-lookup drafts fed, and kept (the two counters)
        self._kept_total = 0
        self._gauges_published: tuple[int, ...] = ()
        self._published_at = -math.inf
        self._compile_pool = ThreadPoolExecutor(cfg.start_threads, thread_name_prefix="llm-grammar-start")
        self._thread = threading.Thread(target=self._loop, name="llm-decode-loop", daemon=True)
        self._thread.start()

    # -- public API -----------------------------------------------------------
    @property
    def active_count(self) -> int:
        """Sequences in the batch now."""
        return len(self._active)

    @property
    def live_count(self) -> int:
        """Requests not finished yet (compiling, waiting, or in the batch)."""
        with self._lock:
            return len(self._live)

    @property
    def max_batch_size(self) -> int:
        return self._max_batch

    @property
    def config(self) -> SchedulerConfig:
        """The settings in force."""
        return self._cfg

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (what its token ids mean)."""
        return self._tokenizer

    def stats(self) -> SchedulerStats:
        """A snapshot of the per-step counters."""
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()

    def summary(self) -> dict[str, float | int]:
        """Percentiles of the per-step counters (logged by the ``llm`` model at shutdown).

        In the Triton deployment ``grammar_s`` is the round trip to the
        grammar model (over its grammar channel), ``grammar_service_s`` the
        grammar model's own work in it, and ``mask_wait_s`` the part of the
        round trip not hidden behind the forward (all of it in processor
        mode), and ``grammar_loop_s`` the decode loop's own time on the
        grammar work (the request, the wait for and reading of the answer,
        masking: what a constrained step spends beyond the forward; also per
        batch size for the equal-work steps).  ``grammar_requests`` counts the
        grammar requests: one per step with a constrained row
        (``steps_constrained``).
        """
        s = self.stats()
        out: dict[str, float | int] = {"steps": s.steps, "max_batch_size_seen": s.max_batch_size_seen}
        for name, values in (("step_s", s.step_s), ("forward_s", s.forward_s), ("grammar_s", s.grammar_s),
                             ("grammar_service_s", s.grammar_service_s), ("mask_wait_s", s.mask_wait_s),
                             ("grammar_loop_s", s.grammar_loop_s)):
            finite = values[np.isfinite(values)]
            for q in (50, 99):
                out[f"{name}_p{q}"] = float(np.percentile(finite, q)) if finite.size else float("nan")
        out["steps_constrained"] = int((s.constrained_rows > 0).sum())
        out["grammar_requests"] = self._phase.requests
        # Equal work: decode steps (no prompt joining) whose rows were all free or
        # all constrained, per batch size; the whole step's time (the grammar
        # wait, masking, sampling and streaming included), and the tokens each
        # such step added (a row that ends adds its end token).
        step = s.step_s
        pure = s.prefill_rows == 0
        for b in np.unique(s.batch_size[pure]):
            at = pure & (s.batch_size == b)
            for kind, rows in (("free", at & (s.constrained_rows == 0)), ("constrained", at & (s.constrained_rows == b))):
                if rows.any():
                    out[f"step_s_p50_b{int(b)}_{kind}"] = float(np.median(step[rows]))
                    out[f"forward_s_p50_b{int(b)}_{kind}"] = float(np.median(s.forward_s[rows]))
                    if kind == "constrained":
                        out[f"grammar_loop_s_p50_b{int(b)}_constrained"] = float(np.median(s.grammar_loop_s[rows]))
                    out[f"steps_b{int(b)}_{kind}"] = int(rows.sum())
                    # More than b with jump-forward: forced tokens ride along.
                    out[f"tokens_per_step_b{int(b)}_{kind}"] = float(s.output_tokens[rows].mean())
        out["output_tokens"] = int(s.output_tokens.sum())
        out["jump_tokens"] = int(s.jump_tokens.sum())
        out["draft_tokens"] = int(s.draft_tokens.sum())
        out["kept_drafts"] = int(s.kept_drafts.sum())
        return out

    def submit(self, request: GenerationRequest, callback: EventCallback) -> str:
        """Queue a request; thread-safe.

        Parameters
        ----------
        request : GenerationRequest
            The request.
        callback : callable
            Receives the request's :class:`TokenEvent` s and its last
            :class:`FinishEvent`, on the loop thread.

        Returns
        -------
        str
            The request id.

        Raises
        ------
        RequestError
            A field is out of range (named in the message).
        Overloaded
            ``max_queued`` requests are held already.
        SchedulerClosed
            After :meth:`close`.
        """
        seq = self._validate(request, callback)
        with self._cond:
            if self._closing:
                raise SchedulerClosed("the scheduler is closed")
            if len(self._live) >= self._cfg.max_queued:
                raise Overloaded(f"{len(self._live)} requests are queued (max_queued {self._cfg.max_queued})")
            # Unguessable ids (128-bit request ids, 64-bit grammar sequence ids):
            # nothing that names a request or a matcher can be derived from
            # another one, and schedulers of several `llm` instances sharing one
            # grammar model cannot clash (a collision is a 2**-64 event per pair).
            if request.request_id is None:
                seq.rid = f"req-{secrets.token_hex(16)}"
            elif seq.rid in self._live:
                raise RequestError("request_id", f"{seq.rid!r} is already in flight")
            seq.seq_id = secrets.randbits(64) or 1
            self._live[seq.rid] = seq
            self._inbox.append(seq)
            self._cond.notify()
        return seq.rid

    def cancel(self, request_id: str) -> bool:
        """Cancel a request at the next step boundary; thread-safe.

        The request gets a last :class:`FinishEvent` with ``finish_reason="error"``
        and ``status="CANCELLED"``; its grammar state is ended.

        Returns
        -------
        bool
            ``True`` if the request was in flight.
        """
        with self._cond:
            if request_id not in self._live:
                return False
            self._cancels.append(request_id)
            self._cond.notify()
            return True

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the loop: every unfinished request ends with an ``UNAVAILABLE`` error."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the decode loop did not stop within {timeout} s")
        self._phase.close()
        self._compile_pool.shutdown(wait=True)
        # Compiles that finished after the loop stopped: their sequences were
        # already failed; free the grammar state they created.
        with self._lock:
            late = list(self._started_q)
            self._started_q.clear()
        ends = [s.seq_id for s, err in late if err is None and not s.ended]
        self._end(ends)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- validation -------------------------------------------------------------
    def _validate(self, req: GenerationRequest, callback: EventCallback) -> _Seq:
        checked = check_request(req, callback, self._cfg, vocab_size=self._vocab, context_len=self._engine.max_seq_len)
        constraint = checked.constraint
        # This loop can drop tokens, so completed JSON values are checked.
        checks = constraint is not None and constraint.kind in contract.JSON_KINDS
        params = checked.params
        spec = self._cfg.draft_tokens if checked.draft_tokens is None else checked.draft_tokens
        if params.penalized or params.logprobs is not None:
            spec = 0  # the server's default does not apply to them (contract.check_draft_tokens)
        return _Seq(
            rid=req.request_id or "",
            seq_id=0,
            prompt=checked.prompt,
            constraint=dataclasses.replace(constraint, value_checks=True) if checks and constraint else constraint,
            out=[] if checks else None,
            max_tokens=req.max_tokens,
            params=checked.params,
            stop=checked.stop,
            callback=callback,
            gen=self._sampler.generator(checked.params.seed),
            detok=IncrementalDetokenizer(self._tokenizer, stop=checked.stop, special_ids=self._special),
            counts=(TokenCounts(self._sampler.vocab_size, checked.prompt, self._sampler.device)
                    if checked.params.penalized else None),
            lps=None if checked.params.logprobs is None else [],
            lookup=PromptLookup(checked.prompt) if spec else None,
            spec=spec,
        )

    # -- the loop -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                if (
                    not self._closing
                    and not self._inbox
                    and not self._cancels
                    and not self._started_q
                    and not self._active
                    and not self._ready
                ):
                    self._cond.wait(self._cfg.idle_wait_s)
                closing = self._closing
                inbox = list(self._inbox)
                self._inbox.clear()
                cancels = self._cancels
                self._cancels = []
                started = list(self._started_q)
                self._started_q.clear()
            try:
                if closing:
                    self._shutdown(inbox, started)
                    return
                self._boundary(inbox, cancels, started)
                if self._active:
                    self._await_starts()
                    self._step()
                self._publish_metrics()
            except Exception as err:  # noqa: BLE001 -- a loop bug: fail every request in flight, keep serving
                _log.exception("decode loop failed; failing every request in flight")
                self._fail_all(f"internal error: {err}", status_of(err))

    def _boundary(self, inbox: list[_Seq], cancels: list[str], started: list[tuple[_Seq, BaseException | None]]) -> None:
        ends: list[int] = []
        if inbox:
            fresh = {seq.rid for seq in inbox if seq.constraint is not None}
            with self._lock:  # before the starts are submitted: each removes its own id when it returns
                self._fresh = fresh
        for seq in inbox:
            if seq.constraint is None:
                self._ready.append(seq)
            else:
                self._starting[seq.rid] = seq
                self._compile_pool.submit(self._run_start, seq, seq.constraint)
        for seq, err in started:
            self._starting.pop(seq.rid, None)
            if err is None:
                seq.started = True
            if seq.finished:  # cancelled (or failed) while compiling
                if seq.started and not seq.ended:
                    seq.ended = True
                    ends.append(seq.seq_id)
                continue
            if err is not None:
                self._finish(seq, "error", ends, error=str(err), status=status_of(err))
            else:
                self._ready.append(seq)
        if cancels:
            wanted = set(cancels)
            for seq in list(self._starting.values()):
                if seq.rid in wanted:
                    self._finish(seq, "error", ends, error="request cancelled", status=CANCELLED)
            for coll in (self._ready, self._active):
                for seq in [s for s in coll if s.rid in wanted and not s.finished]:
                    self._finish(seq, "error", ends, error="request cancelled", status=CANCELLED)
            self._purge()
        self._admit()
        self._end(ends)

    def _admit(self) -> None:
        """Move ready requests into the batch, oldest first, within the batch size and the step's
        prefill budget (``max_prefill_tokens``: rows times the longest prompt; the first always joins)."""
        if not self._ready:
            return
        joining = [s for s in self._active if not s.in_engine]  # admitted at this step's earlier boundary
        rows = len(joining)
        width = max((len(s.prompt) for s in joining), default=0)
        budget = self._prefill_budget
        while self._ready and len(self._active) < self._max_batch:
            wider = max(width, len(self._ready[0].prompt))
            if rows and (rows + 1) * wider > budget:
                return
            seq = self._ready.popleft()
            self._active.append(seq)
            self._logprobs = self._logprobs or seq.lps is not None
            rows, width = rows + 1, wider

    def _await_starts(self) -> None:
        """Give the starts submitted at this boundary a moment to finish, so their requests join this step."""
        with self._cond:
            fresh = self._fresh
            if not fresh:
                return
            wait = min(self._cfg.start_wait_s, self._last_step_s / 2)
            if wait > 0 and len(self._active) < self._max_batch:
                self._cond.wait_for(lambda: not fresh, wait)
            self._fresh = set()
            started = list(self._started_q)
            self._started_q.clear()
        if started:
            self._boundary([], [], started)

    def _run_start(self, seq: _Seq, constraint: ConstraintRequest) -> None:
        err: BaseException | None = None
        try:
            seq.backend = self._provider.start(seq.seq_id, constraint)
        except Exception as exc:  # noqa: BLE001 -- delivered to the request as its FinishEvent
            err = exc
            if status_of(exc) == "INTERNAL":
                _log.exception("MaskProvider.start failed for request %s", seq.rid)
        with self._cond:
            self._started_q.append((seq, err))
            self._fresh.discard(seq.rid)
            self._cond.notify()

    def _step(self) -> None:
        """One decode step of the running batch, in this order (each phase reads what the ones before left):

        1. The rows: decoding ones first, then the prompts that join (or one
           chunk of a long prompt); the speculating rows' drafts
           (:meth:`_propose`).
        2. The grammar step is launched for the constrained rows
           (:meth:`GrammarPhase.launch`: overlap mode sends it now, so the
           grammar side works while the forward runs), with their drafts.
        3. The forward: decode (or extend, feeding jump-forward tokens or a
           token and its drafts), then the joining prompts' prefill.
        4. The grammar answer is collected (:meth:`GrammarPhase.collect`); a
           failed forward fails the batch here.
        5. The answer is applied (:meth:`_apply_grammar`): masks onto the
           logits, and per row its kind (error, stop, value-check drop), close
           state, held tokens and forced tokens.
        6. Sampling, the drafts' verification (:meth:`_verify`), then per row:
           the jump it takes, or its token (or its kept drafts and the token
           after them, :meth:`_take_run`), its end (stop token, stop string,
           ``max_tokens``) or its streamed delta (held tokens stay back until a
           value check can no longer drop them).
        7. Step metrics, the jump and draft decisions' cost table, and the ends.
        """
        t_step = time.perf_counter()
        active = self._active
        dec = [s for s in active if s.in_engine]
        new = [s for s in active if not s.in_engine]
        chunk, chunk_stop = None, 0
        if len(new) == 1 and len(new[0].prompt) > self._prefill_budget:
            # A prompt longer than the bound (it joined alone, _admit): its next chunk runs after the
            # decode forward; it samples and reaches the grammar side at the step of its last chunk.
            chunk = new[0]
            chunk_stop = min(len(chunk.prompt), chunk.prefilled + self._prefill_budget)
            if chunk_stop < len(chunk.prompt):
                new = []
        order = dec + new
        b = len(order)
        nd = len(dec)
        constrained = [i for i, s in enumerate(order) if s.constraint is not None]
        c = len(constrained)
        widths = self._jumps if c else self._free_widths
        drafting = self._propose(dec, widths)
        phase = self._phase
        if c:
            phase.launch([order[i] for i in constrained])

        ends: list[int] = []
        t0 = time.perf_counter()
        width = max((max(len(s.jump), 1 + len(s.drafts)) for s in dec), default=1) if drafting else \
            max((len(s.jump) for s in dec), default=0) or 1
        forward_err: BaseException | None = None
        logits: torch.Tensor | None = None
        every: torch.Tensor | None = None  # [nd, width, V] where a row drafts: the logits after each fed token
        try:
            if dec:
                ids = [s.seq_id for s in dec]
                if drafting:
                    feed, counts = self._jump_feed(dec, width)
                    every = self._engine.extend(ids, feed, counts, every=True)
                    # A row's own next token is sampled after its last token: a drafting row's first position,
                    # a jumping row's last.
                    last = np.where(np.fromiter((bool(s.drafts) for s in dec), bool, nd), 0, counts - 1)
                    out = every[torch.arange(nd, device=every.device), torch.from_numpy(last).to(every.device)]
                elif width > 1:
                    out = self._engine.extend(ids, *self._jump_feed(dec, width))
                else:
                    out = self._engine.decode(ids, np.fromiter((s.last_token for s in dec), np.int64, nd))
                if new:
                    self._logits[:nd].copy_(out)
                    logits = self._logits[:b]
                else:
                    logits = out
            else:
                logits = self._logits[:b]
        except Exception as err:  # noqa: BLE001 -- fails the batch's requests with the error
            forward_err = err
        for s in dec:
            s.jump = ()  # fed: the engine and the grammar step have them
            s.accepted = ()
        prefill_failed: list[tuple[_Seq, BaseException]] = []
        if forward_err is None and logits is not None and chunk is not None:
            try:
                row = self._engine.prefill_chunk(chunk.seq_id, chunk.prompt, chunk_stop)
            except Exception as err:  # noqa: BLE001 -- fails the chunked request with the error
                prefill_failed.append((chunk, err))
                if new:
                    logits[nd:b].zero_()  # the row is retired below; keep its logits finite
            else:
                chunk.prefilled = chunk_stop
                if row is not None:
                    chunk.in_engine = True
                    logits[nd:b].copy_(row)
        elif forward_err is None and logits is not None and new:
            # Every prompt that joins now in ONE forward (left-padded, TorchEngine.prefill_batch).
            try:
                rows = self._engine.prefill_batch([s.seq_id for s in new], [s.prompt for s in new])
            except Exception as err:  # noqa: BLE001 -- fails the joining requests with the error
                prefill_failed.extend((s, err) for s in new)
                logits[nd:b].zero_()  # the rows are retired below; keep their logits finite
            else:
                for s in new:
                    s.in_engine = True
                logits[nd:b].copy_(rows)
        fwd_s = time.perf_counter() - t0
        joined = len(new) if chunk is None else 1
        if c:
            # Overlap: the answer is waited for now; processor mode: the request runs now.
            phase.collect(self._bitmask_np.shape[1])
        self._steps_total += 1
        self._lat_grammar.add(phase.call_s if c else math.nan)
        self._lat_wait.add(phase.wait_s if c else math.nan)

        if forward_err is not None or logits is None:
            err_any: BaseException = forward_err if forward_err is not None else RuntimeError("no logits")
            _log.error("forward failed (%s); failing the %d sequences of the batch", err_any, b)
            self._engine_reset()
            for s in active:
                self._finish(s, "error", ends, error=f"forward failed: {err_any}", status=status_of(err_any),
                             release=False)
            self._record(t_step, fwd_s, phase if c else None, b, c, joined, 0, 0)
            self._purge()
            self._end(ends)
            return
        for s, perr in prefill_failed:
            # A failed chunk registered nothing (TorchEngine.prefill_chunk): no slot to release.
            self._finish(s, "error", ends, error=f"prefill failed: {perr}", status=status_of(perr),
                         release=s is not chunk)
        if not order:  # only a chunk of a long prompt ran: nothing samples
            self._record(t_step, fwd_s, None, 0, 0, joined, 0, 0)
            self._purge()
            self._end(ends)
            return
        if c:
            t_apply = time.perf_counter()
            self._apply_grammar(order, constrained, logits, ends)
            phase.charge(time.perf_counter() - t_apply)

        tokens, dead = self._sampler.sample(logits, [s.params for s in order], [s.gen for s in order],
                                            [len(s.jump) for s in order],
                                            [s.counts for s in order] if any(s.counts is not None for s in order) else None)
        step_lps = self._step_logprobs(order, logits, tokens, dead) if self._logprobs else None
        runs = self._verify(dec, constrained, tokens, dead, every) if every is not None else {}
        outputs = jumped = kept = 0
        for i, s in enumerate(order):
            if s.finished or s.refeed:
                continue
            if s.jump:
                n = self._take_jump(s, ends)
                outputs += n
                jumped += n
                continue
            if dead[i]:
                self._finish(s, "error", ends, error="no token is allowed at this step", status="INTERNAL")
                continue
            run = runs.get(i)
            if run is not None:
                outputs += self._take_run(s, run[0], run[1], ends)
                kept += len(run[0]) - 1
                continue
            tok = int(tokens[i])
            s.generated += 1
            outputs += 1
            if s.close_state in REASONING_STATES:
                s.reasoning_tokens = (s.reasoning_tokens or 0) + 1
                s.reasoning_cut = s.reasoning_cut or s.close_state == CloseState.REASONING_END
            s.last_token = tok
            if s.counts is not None:
                s.counts.add((tok,))
            if tok in self._eos:  # not part of the output (nor of its log probabilities)
                self._finish(s, "stop", ends)
                continue
            if s.lookup is not None:
                s.lookup.extend((tok,))
            if s.lps is not None and step_lps is not None:
                s.lps.append(step_lps[i])
            sent: tuple[int, ...] = (tok,)
            if s.out is None:
                delta = s.detok.push(tok)
            else:
                s.out.append(tok)
                safe = tok == s.safe_token and not s.held
                delta, sent = self._commit(s, len(s.out) - (0 if safe else 1) - s.held)
            if s.detok.stopped:
                self._finish(s, "stop", ends, delta=delta, tokens=sent, stop_string=True)
            elif s.generated >= s.max_tokens:
                self._finish(s, "length", ends, delta=delta, tokens=sent)
            elif sent:
                self._deliver(s, self._event(s, delta, sent))
        drafted = sum(len(s.drafts) for s in dec) if every is not None else 0
        self._drafts_total += drafted
        self._kept_total += kept
        step_s = self._record(t_step, fwd_s, phase if c else None, b, c, joined, outputs, jumped, drafted, kept)
        if not joined:
            # What a step of this width costs, whole (forward, grammar, masking, streaming),
            # for the jump and draft decisions of the next steps.
            widths.record(nd, width, step_s)
        self._purge()
        self._end(ends)

    def _record(self, t_step: float, fwd_s: float, phase: GrammarPhase | None, b: int, c: int, joined: int,
                outputs: int, jumped: int, drafted: int = 0, kept: int = 0) -> float:
        step_s = time.perf_counter() - t_step
        self._last_step_s = step_s
        self._lat_step.add(step_s)
        self._lat_loop.add(math.nan if phase is None else phase.loop_s)
        self._stats.record(step_s, fwd_s, phase, b, c, joined, outputs, jumped, drafted, kept)
        return step_s

    def _verify(self, dec: list[_Seq], constrained: list[int], tokens: np.ndarray, dead: np.ndarray,
                every: torch.Tensor) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Speculation's verification: the drafts each drafting row keeps, and the token sampled after them.

        A row's token at its first position is sampled with the batch (``tokens``).  While it equals
        the row's next draft, and the grammar holds that draft (``draft_valid``), the draft is kept
        and the position after it is sampled, under that position's mask (``draft_bitmask``), from
        the logits the forward computed there (``every``): each kept token is the one a step of its
        own would have sampled, with the same draw of the row's generator.  The rows still going
        are sampled together, one position at a time.  The cache keeps the kept drafts only
        (:meth:`Engine.truncate`).

        Returns
        -------
        dict
            By batch row, for a row that kept at least one draft: its tokens (the kept drafts, then
            the sampled token) and the close state of the position where each was sampled.
        """
        phase = self._phase
        mstep, rows = phase.step, phase.rows
        column = {i: j for j, i in enumerate(constrained)}
        valid = mstep.draft_valid.tolist() if mstep is not None and mstep.draft_valid is not None else None
        closing = mstep.draft_closing if mstep is not None else None
        masks = mstep.draft_bitmask if mstep is not None else None
        walks: list[_Walk] = []
        for i, s in enumerate(dec):
            if not s.drafts or s.finished or s.refeed or (dead[i] and not s.jump):
                continue
            j = column.get(i, -1)
            # A row the grammar makes jump keeps none: it jumps as it would have without drafts.
            limit = 0 if s.jump else len(s.drafts) if j < 0 else (valid[j] if valid is not None else 0)
            walks.append(_Walk(i, j, limit, int(tokens[i]), [rows.close[j] if j >= 0 and rows is not None else 0]))

        def goes(w: _Walk) -> bool:  # the token sampled is the next draft, the grammar holds it, it ends nothing
            return w.kept < w.limit and w.last == dec[w.row].drafts[w.kept] and w.last not in self._eos

        going = [w for w in walks if goes(w)]
        pos = 1
        width = self._bitmask_np.shape[1]
        while going:
            lg = every[torch.tensor([w.row for w in going], device=every.device), pos]  # a copy: sampling writes it
            cons = [r for r, w in enumerate(going) if w.col >= 0]
            if cons and masks is not None:
                bm = np.full((len(going), width), -1, dtype=np.int32)
                bm[cons] = masks[pos - 1, [going[r].col for r in cons]]
                self._sampler.apply_mask(lg, bm if self._device.type == "cpu" else torch.from_numpy(bm).to(self._device),
                                         cons)
            toks, gone = self._sampler.sample(lg, [dec[w.row].params for w in going], [dec[w.row].gen for w in going])
            nxt = []
            for r, w in enumerate(going):
                w.kept += 1  # the draft left of this position is the token sampled before it
                if gone[r]:
                    dead[w.row] = True  # never where the grammar holds the draft: finished as a dead row
                    continue
                w.last = int(toks[r])
                w.closes.append(int(closing[w.col, pos - 1]) if w.col >= 0 and closing is not None else 0)
                if goes(w):
                    nxt.append(w)
            going = nxt
            pos += 1
        runs: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for w in walks:
            s = dec[w.row]
            if dead[w.row] and not s.jump:
                continue  # finished by the caller: its slot is released
            rejected = len(s.drafts) - w.kept
            if rejected:
                self._engine.truncate(s.seq_id, self._engine.length(s.seq_id) - rejected)
            if s.lookup is not None and not s.jump:  # a jump drops drafts whatever they were
                s.lookup.kept(w.kept, len(s.drafts))
            if w.kept:
                runs[w.row] = ((*s.drafts[: w.kept], w.last), tuple(w.closes))
        return runs

    def _take_run(self, s: _Seq, toks: tuple[int, ...], closes: tuple[int, ...], ends: list[int]) -> int:
        """Append a drafting row's kept drafts and the token sampled after them (:meth:`_verify`), each as
        a step of its own would (close state, thinking count, end token, stop string, ``max_tokens``);
        returns the tokens taken."""
        lookup = s.lookup
        taken = 0
        delta = ""
        sent: list[int] = []
        for tok, state in zip(toks, closes, strict=True):
            s.close_state = state
            s.generated += 1
            taken += 1
            if state in REASONING_STATES:
                s.reasoning_tokens = (s.reasoning_tokens or 0) + 1
                s.reasoning_cut = s.reasoning_cut or state == CloseState.REASONING_END
            s.last_token = tok
            if tok in self._eos:
                if s.out is not None:
                    self._finish(s, "stop", ends)
                else:
                    self._finish(s, "stop", ends, delta=delta, tokens=tuple(sent))
                return taken
            if lookup is not None:
                lookup.extend((tok,))
            if s.out is None:
                delta += s.detok.push(tok)
                sent.append(tok)
                if s.detok.stopped:
                    self._finish(s, "stop", ends, delta=delta, tokens=tuple(sent), stop_string=True)
                    return taken
            else:
                s.out.append(tok)
        out_sent: tuple[int, ...] = tuple(sent)
        if s.out is not None:
            # None of them is accepted by the grammar yet (the next step sends them): held with its hold.
            delta, out_sent = self._commit(s, len(s.out) - taken - s.held)
            if s.detok.stopped:
                self._finish(s, "stop", ends, delta=delta, tokens=out_sent, stop_string=True)
                return taken
        if s.generated >= s.max_tokens:
            self._finish(s, "length", ends, delta=delta, tokens=out_sent)
        else:
            s.accepted = toks[:-1]
            if out_sent:
                self._deliver(s, self._event(s, delta, out_sent))
        return taken

    def _step_logprobs(self, order: list[_Seq], logits: torch.Tensor, tokens: np.ndarray,
                       dead: np.ndarray) -> dict[int, TokenLogprobs]:
        """The entry of each drawn token whose request asked for log probabilities, by batch row.

        One batched :meth:`Sampler.logprobs` for those rows (rows that jump
        append forced tokens instead: :func:`~llm_runtime.logprobs.forced`);
        alternatives the mask disallows (``-inf``) are left out.
        """
        rows = [i for i, s in enumerate(order)
                if s.lps is not None and not (s.jump or s.finished or s.refeed or dead[i])]
        if not rows:
            return {}
        ks = [order[i].params.logprobs or 0 for i in rows]
        chosen, top_ids, top_lps = self._sampler.logprobs(logits, rows, tokens, max(ks))
        finite = np.isfinite(top_lps).sum(axis=1).tolist()
        ids, lps, drawn = top_ids.tolist(), top_lps.tolist(), chosen.tolist()
        return {i: TokenLogprobs(int(tokens[i]), drawn[j], tuple(zip(ids[j][:n], lps[j][:n], strict=True)))
                for j, (i, n) in enumerate(zip(rows, (min(k, f) for k, f in zip(ks, finite, strict=True)),
                                               strict=True))}

    def _event(self, s: _Seq, delta: str, sent: tuple[int, ...]) -> TokenEvent:
        """The event streaming ``sent`` (and ``delta``): with their log-probability entries where asked."""
        lps = s.lps
        if lps is None or not sent:
            return TokenEvent(delta, sent)
        n = len(sent)
        entries = tuple(lps[:n])
        del lps[:n]
        return TokenEvent(delta, sent, entries)

    def _apply_grammar(self, order: list[_Seq], constrained: list[int], logits: torch.Tensor,
                       ends: list[int]) -> None:
        """Read the step's grammar answer for each constrained row, and mask the rows that sample.

        A row whose grammar failed, ended or dropped tokens is finished or fed
        again here; the others keep their mask and, where the grammar forces
        two or more tokens, a jump (cut to this step's width: :meth:`_fit_jumps`).
        """
        phase = self._phase
        mstep, rows = phase.step, phase.rows
        if mstep is None or rows is None:
            bad = phase.error
            for i in constrained:
                self._finish(order[i], "error", ends, error=f"grammar step failed: {bad}",
                             status="INTERNAL" if bad is None or isinstance(bad, str) else status_of(bad))
            return
        sel: list[int] = []
        masked: list[int] = []
        for j, i in enumerate(constrained):
            s = order[i]
            s.refeed = False
            if s.finished:
                continue
            s.close_state = rows.close[j]
            s.held = rows.held[j]
            kind = rows.kind[j]
            if kind == ROW_ERROR:
                # The grammar side reports row errors as text only; after
                # admission they are server-side failures.
                self._finish(s, "error", ends, error=mstep.errors[j], status="INTERNAL")
            elif kind == ROW_STOP:
                self._finish(s, "stop", ends)
            elif kind == ROW_DROP:
                self._drop(s, int(mstep.dropped[j]) if mstep.dropped is not None else 0, ends)
            else:
                sel.append(j)
                masked.append(i)
                # Room for the stop token stays: a jump never ends the output at max_tokens.
                s.jump = mstep.forced(j, min(self._cfg.max_jump_tokens, s.max_tokens - s.generated - 1),
                                      rows.forced[j]) if rows.forced[j] >= 2 else ()
                s.jump_safe = rows.forced_safe[j]
                # The output's first forced run when it is not jumped (one token, `[` or `{`, or a jump the
                # policy dropped): its first token, once sampled, streams at once like a jump's, not a
                # step later (a step of time to first token).
                s.safe_token = int(mstep.forced_tokens[j, 0]) if s.jump_safe and mstep.forced_tokens is not None \
                    else -1
        self._fit_jumps(order)
        if masked:
            if masked[-1] == sel[-1] == len(sel) - 1:  # both are 0..k-1 (ascending, distinct): every row masks
                if self._device.type == "cpu":
                    # The logits are on the host: masked straight from the answer's rows (a copy into
                    # the batch's tensor first cost more: docs/benchmarks.md, the serving path's fifth round).
                    self._sampler.apply_mask(logits, mstep.bitmask[: len(sel)], masked)
                    return
                self._bitmask_np[: len(sel)] = mstep.bitmask[: len(sel)]
            else:
                self._bitmask_np[masked] = mstep.bitmask[sel]
            bitmask = self._bitmask_host[: len(order)]
            if self._bitmask_dev is not None:
                bitmask = self._bitmask_dev[: len(order)].copy_(bitmask, non_blocking=True)
            self._sampler.apply_mask(logits, bitmask, masked)

    def _fit_jumps(self, order: list[_Seq]) -> None:
        """Cut this step's jumps to the width the measured forward cost favours
        (:class:`~llm_runtime.grammar_phase.JumpPolicy`); drop them when a plain step does better."""
        lengths = [len(s.jump) for s in order if s.jump]
        if not lengths:
            return
        width = self._jumps.width(lengths, len(order))
        for s in order:
            if s.jump:
                s.jump = s.jump[:width] if width else ()

    def _jump_feed(self, dec: list[_Seq], width: int) -> tuple[np.ndarray, np.ndarray]:
        """The decode rows' input for :meth:`Engine.extend`: each row's jump tokens, or its last token
        and its drafts."""
        feed = np.zeros((len(dec), width), dtype=np.int64)
        counts = np.ones(len(dec), dtype=np.int64)
        for r, s in enumerate(dec):
            if s.jump:
                feed[r, : len(s.jump)] = s.jump
                counts[r] = len(s.jump)
            else:
                feed[r, 0] = s.last_token
                if s.drafts:
                    n = len(s.drafts)
                    feed[r, 1 : 1 + n] = s.drafts
                    counts[r] = 1 + n
        return feed, counts

    def _propose(self, dec: list[_Seq], widths: JumpPolicy) -> bool:
        """Each speculating row's drafts for this step (prompt lookup); whether any row has some.

        A row that jumps, is fed again after a drop, or has room for no token past its next one
        drafts nothing.  The drafts are cut to the width whose expected kept tokens pay for the
        wider forward every row of the step runs (:meth:`JumpPolicy.draft_width`, each row's
        :attr:`PromptLookup.acceptance`; none where a plain step does better).
        """
        proposing: list[tuple[_Seq, PromptLookup]] = []
        for s in dec:
            lookup = s.lookup
            if lookup is None:  # only a speculating row ever has drafts
                continue
            s.drafts = ()
            if s.jump or s.refeed:
                continue
            room = min(s.spec, s.max_tokens - s.generated - 1)
            if room > 0:
                s.drafts = lookup.propose(room)
                if s.drafts:
                    proposing.append((s, lookup))
                else:
                    lookup.idle()
        if not proposing:
            return False
        floor = max(1, max(len(s.jump) for s in dec))
        base = sum(len(s.jump) or 1 for s in dec)
        width = widths.draft_width(len(dec), floor, base, [(len(s.drafts), lk.acceptance) for s, lk in proposing])
        for s, lookup in proposing:
            s.drafts = s.drafts[: width - 1]
            if not s.drafts:
                lookup.idle()
        return any(s.drafts for s, _ in proposing)

    def _commit(self, s: _Seq, upto: int) -> tuple[str, tuple[int, ...]]:
        """Stream ``s.out[s.committed:upto]`` (no value check can drop them any more): their text and ids.

        Stops at a stop string (``s.detok.stopped``): the tokens after it are
        not part of the output and not counted, as if never sampled.
        """
        out = s.out
        if out is None or upto <= s.committed:
            return "", ()
        delta = ""
        start = s.committed
        for n in range(start, upto):
            delta += s.detok.push(out[n])
            if s.detok.stopped:
                upto = n + 1
                s.generated -= len(out) - upto
                del out[upto:]
                if s.lps is not None:  # aligned with out[start:]
                    del s.lps[upto - start:]
                break
        s.committed = upto
        return delta, tuple(out[start:upto])

    def _drop(self, s: _Seq, count: int, ends: list[int]) -> None:
        """A value check dropped the row's last ``count`` tokens: forget them, and feed the token before them again."""
        out = s.out
        keep = -1 if out is None else len(out) - count
        if out is None or keep < s.committed:  # never: the grammar side holds back what it may drop
            self._finish(s, "error", ends, error=f"the grammar side dropped {count} tokens, "
                         f"{len(out or ())} generated and {s.committed} already streamed", status="INTERNAL")
            return
        if s.counts is not None:
            s.counts.add(out[keep:], -1.0)
        if s.lps is not None:  # aligned with out[committed:]
            del s.lps[keep - s.committed:]
        del out[keep:]
        s.generated -= count
        s.retries += 1
        s.dropped += count
        s.jump, s.jump_safe = (), 0
        s.refeed = True
        prompt_len = int(s.prompt.shape[0])
        s.last_token = out[-1] if out else int(s.prompt[-1])
        if s.lookup is not None:
            s.lookup.truncate(prompt_len + keep)
        # The cache holds the prompt and every token fed so far, the dropped ones too.
        self._engine.truncate(s.seq_id, prompt_len + keep - 1)

    def _take_jump(self, s: _Seq, ends: list[int]) -> int:
        """Append ``s.jump`` (forced, not sampled) to the output; returns the tokens taken."""
        toks = s.jump
        if s.counts is not None:
            s.counts.add(toks)
        if s.lookup is not None:
            s.lookup.extend(toks)
        if s.lps is not None:
            k = s.params.logprobs or 0
            s.lps.extend(forced(t, k) for t in toks)
        if s.out is not None:
            s.out.extend(toks)
            s.generated += len(toks)
            s.last_token = toks[-1]
            # Held until the grammar has accepted them and says what a check may still drop, but for
            # what it said already cannot be (the output's first forced run, `{"name":`: at once).
            before = len(s.out) - len(toks)
            upto = before + min(len(toks), s.jump_safe) if s.jump_safe else before - s.held
            delta, sent = self._commit(s, upto)
            if s.detok.stopped:
                self._finish(s, "stop", ends, delta=delta, tokens=sent, stop_string=True)
            elif sent:
                self._deliver(s, self._event(s, delta, sent))
            return len(toks)
        delta = ""
        for n, tok in enumerate(toks, 1):
            delta += s.detok.push(tok)
            if s.detok.stopped:
                s.generated += n
                self._finish(s, "stop", ends, delta=delta, tokens=toks[:n], stop_string=True)
                return n
        s.generated += len(toks)
        s.last_token = toks[-1]
        self._deliver(s, self._event(s, delta, toks))
        return len(toks)

    def _publish_metrics(self) -> None:
        """Hand the ``llm`` metrics to ``on_metrics`` when a gauge moved or the interval passed."""
        if self._on_metrics is None:
            return
        with self._lock:
            live = len(self._live)
        active = self._active
        gauges = (live, len(active), len(self._starting) + len(self._ready),
                  sum(1 for s in active if s.constraint is not None))
        now = time.monotonic()
        since = now - self._published_at
        # Never within the gap (a moved gauge waits it out: the loop comes back within idle_wait_s).
        if since < PUBLISH_MIN_GAP_S or (
            gauges == self._gauges_published and (since < self._cfg.metrics_interval_s or not active)
        ):
            return
        snap = Snapshot()
        for name, value in zip(("llm_live_requests", "llm_batch_size", "llm_waiting_requests",
                                "llm_constrained_sequences"), gauges, strict=True):
            snap.put(name, value)
        snap.put("llm_steps_total", self._steps_total)
        snap.put("llm_draft_tokens_total", self._drafts_total)
        snap.put("llm_draft_tokens_kept_total", self._kept_total)
        snap.put_latency("llm_step_seconds", self._lat_step)
        snap.put_latency("llm_grammar_roundtrip_seconds", self._lat_grammar)
        snap.put_latency("llm_mask_wait_seconds", self._lat_wait)
        snap.put_latency("llm_grammar_loop_seconds", self._lat_loop)
        self._gauges_published = gauges
        self._published_at = now
        try:
            self._on_metrics(snap)
        except Exception:  # noqa: BLE001 -- metrics must never fail requests; logged, the next snapshot retries
            _log.exception("publishing the llm metrics failed")

    # -- finishing --------------------------------------------------------------------
    def _finish(
        self,
        seq: _Seq,
        reason: FinishReason,
        ends: list[int],
        *,
        error: str | None = None,
        status: str | None = None,
        delta: str = "",
        tokens: tuple[int, ...] = (),
        release: bool = True,
        stop_string: bool = False,
    ) -> None:
        """Retire ``seq``: free its slot, queue its grammar end, send the last events."""
        if seq.finished:
            return
        reason, close_reason = closed_finish(reason, seq.close_state, stop_string)
        seq.finished = True
        if release and (seq.in_engine or seq.prefilled):
            self._engine.release(seq.seq_id)
        seq.in_engine = False
        seq.prefilled = 0
        if seq.started and not seq.ended:
            seq.ended = True
            ends.append(seq.seq_id)
        if seq.out is not None and not seq.detok.stopped:  # the end: nothing can be dropped any more
            flushed, rest = self._commit(seq, len(seq.out))
            delta, tokens = delta + flushed, tokens + rest
            stop_string = stop_string or seq.detok.stopped
        tail = seq.detok.finish()
        with self._lock:
            self._live.pop(seq.rid, None)
        text_delta = delta + tail
        if text_delta or tokens:
            self._deliver(seq, self._event(seq, text_delta, tokens))
        text = seq.detok.text
        self._deliver(
            seq,
            FinishEvent(
                finish_reason=reason,
                text=text,
                prompt_tokens=int(seq.prompt.shape[0]),
                completion_tokens=seq.generated,
                error=error,
                status=status,
                close_reason=close_reason,
                stop_string=stop_string,
                backend=seq.backend,
                value_retries=seq.retries,
                value_dropped_tokens=seq.dropped,
                reasoning_tokens=seq.reasoning_tokens,
                reasoning_cut=seq.reasoning_cut,
                seed=seq.params.seed,
            ),
        )

    def _deliver(self, seq: _Seq, event: TokenEvent | FinishEvent) -> None:
        try:
            seq.callback(event)
        except Exception:  # noqa: BLE001 -- a caller's bug must not stop the loop; logged, request cancelled
            _log.exception("event callback of request %s raised; cancelling the request", seq.rid)
            if not seq.finished:
                with self._cond:
                    self._cancels.append(seq.rid)

    def _purge(self) -> None:
        if any(s.finished for s in self._active):
            self._active = [s for s in self._active if not s.finished]
            self._logprobs = any(s.lps is not None for s in self._active)
        if any(s.finished for s in self._ready):
            self._ready = deque(s for s in self._ready if not s.finished)

    def _end(self, seq_ids: list[int]) -> None:
        if not seq_ids:
            return
        try:
            self._provider.end(seq_ids)
        except Exception:  # noqa: BLE001 -- nothing left to fail; logged and counted
            _log.exception("MaskProvider.end failed for %d sequences", len(seq_ids))
            with self._stats.lock:
                self._stats.end_errors += 1

    def _engine_reset(self) -> None:
        release_all = getattr(self._engine, "release_all", None)
        if callable(release_all):
            release_all()
        else:
            for s in self._active:
                if s.in_engine or s.prefilled:
                    self._engine.release(s.seq_id)
        for s in self._active:
            s.in_engine = False
            s.prefilled = 0

    def _fail_all(self, error: str, status: str) -> None:
        ends: list[int] = []
        self._engine_reset()
        for coll in (list(self._active), list(self._ready), list(self._starting.values())):
            for s in coll:
                self._finish(s, "error", ends, error=error, status=status, release=False)
        self._purge()
        self._end(ends)

    def _shutdown(self, inbox: list[_Seq], started: list[tuple[_Seq, BaseException | None]]) -> None:
        ends: list[int] = []
        for seq, err in started:
            self._starting.pop(seq.rid, None)
            if err is None:
                seq.started = True
            if seq.finished and seq.started and not seq.ended:
                seq.ended = True
                ends.append(seq.seq_id)
            elif not seq.finished:
                self._ready.append(seq)
        self._end(ends)
        for seq in inbox:
            self._ready.append(seq)
        self._fail_all("the scheduler is shutting down", "UNAVAILABLE")
