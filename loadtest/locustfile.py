"""Locust load test of the ``constrained_llm`` ensemble over gRPC streaming (and OpenAI's API), every output checked.

Run it with ``make loadtest`` (headless, bounded, reports under
``build/loadtest``), or by hand against a running server::

    .venv/bin/locust -f loadtest/locustfile.py --host 127.0.0.1:8001 --headless -u 8 -r 8 -t 60s \\
        --shape ramp --tags constrained unconstrained

Each user keeps one stream in flight (closed loop) through the project's SDK
(``client.Client.stream``, over ``tritonclient.grpc`` streaming, made
cooperative with ``grpc.experimental.gevent``).  Per request three kinds of
locust entries are fired: ``grpc <kind>`` (whole request; its size is the
completion tokens), ``ttft <kind>`` (time to the first text) and ``itl
<kind>`` (each gap between text deltas).  The users run each kind in the
mix once (``--min-per-kind`` N: N times) before the weighted draw begins,
so a short run still measures all of them.  A request is a success only when
:func:`loadtest.workload.judge` accepts its output (or, for a bad input, its
exact status); anything else is a locust failure with the reason, and locust
then exits 1.

The ``openai`` task (given ``--openai-url``, e.g.
``http://127.0.0.1:8080/v1``; without it the task is excluded and the mix
is the gRPC one) streams a strict ``json_schema`` chat completion through the
``openai`` package (one client per user, no retries) to the OpenAI-compatible
endpoint; it fires ``http openai`` (size: the usage chunk's completion
tokens), ``ttft openai`` and ``itl openai`` (content deltas), and
:func:`loadtest.workload.judge_chat` decides its success.

Options added to locust's: ``--shape steady|ramp|spike`` (with ``-u``, ``-r``
and ``-t``: ramp climbs to ``-u`` users over 80 % of ``-t``; spike runs a
quarter of ``-u`` with a full ``-u`` burst in the middle fifth),
``--max-tokens``, ``--data-dir`` and ``--sample`` (MaskBench schemas; with
``--openai-url`` as many again that OpenAI's strict mode takes, for the
``openai`` task), ``--model-dir`` (tokenizer used to pre-compile them),
``--outputs-json`` (per-kind counts of valid, closed-early and failed
outputs), ``--openai-url``, ``--max-requests`` (stop after that many
requests in all), ``--min-per-kind`` and ``--deadline``.

A run ends at ``-t`` (the shape's end), or earlier at ``--max-requests``.
With ``--min-per-kind N`` counts end it instead, not the host's speed: past
``-t`` the shape holds its last level until every kind in the mix (the
tasks left after ``--tags``/``--exclude-tags``) has ended N requests,
whatever their outcome (a failure fails the run, it does not prolong it);
``-t`` is then the least run time (a spike always runs its burst) and
``--deadline`` (default 15m) the most, which only a hang reaches: the run
then stops and fails, naming the kinds still short.
"""

from __future__ import annotations

# Before any gRPC channel exists: grpc's own threads become gevent-cooperative.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import json
import queue
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import openai
import tritonclient.grpc as grpcclient
from locust import LoadTestShape, User, constant, events, tag, task
from locust.env import Environment
from locust.runners import Runner
from locust.util.timespan import parse_timespan

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from client import Client, ClientError
from client.sdk import DEFAULT_MODEL as MODEL
from loadtest.summary import REQUEST_TYPES
from loadtest.workload import (
    DEFAULT_DATA,
    SHAPES,
    ChatStream,
    Job,
    SchemaCheck,
    Workload,
    chat_request,
    exclude_tags,
    judge,
    judge_chat,
    judge_refusal,
    kinds_short,
    openai_base_url,
    shape_tick,
)

#: The ``openai`` client needs a key; a server without API keys ignores it.
OPENAI_API_KEY: str = "loadtest"
_STATE: dict[str, Any] = {}
#: kind -> outcome ("valid", "closed:budget", "failed", ...) -> count; written by --outputs-json.
OUTPUTS: defaultdict[str, Counter[str]] = defaultdict(Counter)
#: kind -> failure reason -> count; written by --outputs-json.
FAILURES: defaultdict[str, Counter[str]] = defaultdict(Counter)
#: Every user's open gRPC clients.  A user the shape removes mid-task may
#: never reach ``on_stop``; a channel left open keeps grpc's gevent threads
#: (and the locust process) alive at exit, so the last ones close at quitting.
OPEN_CLIENTS: set[Any] = set()
#: kind -> its requests running now (see :meth:`ConstrainedLlmUser._next_task`).
RUNNING: Counter[str] = Counter()
#: kind -> its requests that ended: judged (success or failure) or raised; not one a stop cut off.
ENDED: Counter[str] = Counter()


def _kind(fn: Any) -> str:
    """The kind of a task function: its one locust tag."""
    (kind,) = fn.locust_tag_set
    return str(kind)


class Failure(Exception):
    """A request that ended, but not as a success (the message is the reason locust groups by)."""


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--shape", choices=SHAPES, default="steady", help="load shape (default steady)")
    parser.add_argument("--max-tokens", type=int, default=96, help="budget of every generating request")
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA), help="MaskBench folder ('' for none)")
    parser.add_argument("--sample", type=int, default=12, help="MaskBench schemas in the mix")
    parser.add_argument("--model-dir", default=str(REPO / "build" / "models" / "smollm2-135m-instruct"),
                        help="model folder whose tokenizer pre-compiles the sampled schemas")
    parser.add_argument("--outputs-json", default="", help="write per-kind output counts here at the end")
    parser.add_argument("--max-requests", type=int, default=0,
                        help="stop (letting running streams finish) after this many requests; 0: no bound")
    parser.add_argument("--openai-url", default="",
                        help="base URL of the OpenAI-compatible endpoint (http://HOST:PORT/v1) for the openai "
                             "task; none: that task is off")
    parser.add_argument("--min-per-kind", type=int, default=0,
                        help="end on counts: past -t (then the least run time; the shape holds its last level) "
                             "run until every kind in the mix has ended this many requests, whatever their "
                             "outcome; 0: end at -t")
    parser.add_argument("--deadline", default="15m",
                        help="with --min-per-kind: the most run time (20s, 15m, 1h), which only a hang reaches; "
                             "the run then stops and fails")


@events.init.add_listener
def _build_workload(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is None:
        return
    data = Path(opts.data_dir) if opts.data_dir else None
    if data is not None and not data.is_dir():
        raise SystemExit(f"--data-dir {data}: not a folder (pass --data-dir '' to use the own schemas only)")
    try:
        url = openai_base_url(opts.openai_url)
        # Tags are filtered when the run starts, after this hook.
        environment.exclude_tags = exclude_tags(opts.exclude_tags, opts.tags, url)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    _STATE["openai_url"] = url
    check = SchemaCheck(Path(opts.model_dir), opts.max_tokens)
    _STATE["workload"] = workload = Workload.build(data, opts.sample, opts.max_tokens, check, openai=url is not None)
    print(f"loadtest: {len(workload.schemas)} JSON schemas: {', '.join(name for name, _, _ in workload.schemas)}")
    if url is not None:
        if not workload.strict:
            raise SystemExit("loadtest: --openai-url: no schema for the openai task (none of the own or sampled "
                             "schemas passes OpenAI's strict mode; raise --sample)")
        print(f"loadtest: openai task on {url}, {len(workload.strict)} strict JSON schemas: "
              f"{', '.join(name for name, _, _ in workload.strict)}")
    _STATE["sent"] = 0
    if opts.min_per_kind < 0:
        raise SystemExit(f"--min-per-kind {opts.min_per_kind}: must be 0 (off) or more")
    _STATE["least"] = max(1, opts.min_per_kind)
    if opts.min_per_kind:
        try:
            _STATE["deadline_s"] = deadline = parse_timespan(opts.deadline)
        except ValueError as err:
            raise SystemExit(f"--deadline {opts.deadline!r}: {err}") from err
        if deadline <= (opts.run_time or 60):
            raise SystemExit(f"--deadline {opts.deadline}: must be later than -t ({opts.run_time or 60} s), "
                             "the least run time of a run that ends on counts")
    if opts.max_requests:
        environment.events.request.add_listener(_bound(opts.max_requests))


def _bound(limit: int) -> Any:
    """A request listener that ends the run after ``limit`` requests (``--max-requests``).

    The shape's next tick ends it (:class:`SelectedShape`), as at ``-t``: the
    one way a run stops.  A second ``runner.quit()`` beside the shape's own
    (this listener's, once) stopped the users twice ("Tried to stop User in
    an unexpected state: stopping").
    """

    def count(request_type: str, **_: Any) -> None:
        if request_type not in REQUEST_TYPES:
            return
        _STATE["sent"] += 1
        if _STATE["sent"] == limit:
            print(f"loadtest: {limit} requests (--max-requests); stopping")
            _STATE["bounded"] = True

    return count


@events.quitting.add_listener
def _write_outputs(environment: Environment, **_: Any) -> None:
    for client in list(OPEN_CLIENTS):
        client.close()
    OPEN_CLIENTS.clear()
    opts = environment.parsed_options
    if opts is not None and opts.outputs_json:
        doc = {"outcomes": {k: dict(v) for k, v in OUTPUTS.items()},
               "failures": {k: dict(v) for k, v in FAILURES.items()}}
        Path(opts.outputs_json).write_text(json.dumps(doc, indent=2))


def _fire(environment: Environment, kind: str, name: str, seconds: float, size: int = 0,
          reason: str | None = None) -> None:
    environment.events.request.fire(request_type=kind, name=name, response_time=seconds * 1000.0,
                                    response_length=size, exception=None if reason is None else Failure(reason),
                                    context={})
    if reason is not None:
        FAILURES[name.split(":", 1)[0]][reason] += 1


class ConstrainedLlmUser(User):
    """One closed-loop client of the ensemble: a stream at a time, the next as soon as it ends."""

    wait_time = constant(0)

    def on_start(self) -> None:
        if not self.host:
            raise SystemExit("--host HOST:PORT is required (the gateway's gRPC endpoint)")
        self.sdk = Client(self.host, timeout_s=600)
        self.raw = grpcclient.InferenceServerClient(self.host)
        self.clients: list[Any] = [self.sdk, self.raw]
        url = _STATE.get("openai_url")
        self.chat = None if url is None else openai.OpenAI(base_url=url, api_key=OPENAI_API_KEY, max_retries=0,
                                                           timeout=600)
        if self.chat is not None:
            self.clients.append(self.chat)
        OPEN_CLIENTS.update(self.clients)
        taskset = self._taskset_instance
        if taskset is None:  # locust's User.run makes it before on_start
            raise RuntimeError("on_start ran before locust made the user's task set")
        #: The tasks of the mix (left after --tags/--exclude-tags), one per kind, heaviest weight first.
        self.coverage = sorted(dict.fromkeys(self.tasks), key=self.tasks.count, reverse=True)
        taskset.get_next_task = self._next_task  # type: ignore[method-assign]

    def _next_task(self) -> Any:
        """The next task: first each kind of the mix, then the weighted draw.

        Every kind runs at least once (``--min-per-kind`` N: N times) however
        short the run: a user's next task is, heaviest weight first, a kind
        with fewer requests ended or running than that, before any weighted
        draw.  Drawn alone, a 45 s CI smoke of 13 requests got no openai task
        (weight 3 of 17: p = 0.08).  Counted across users when the request
        runs, not when a user queues it: a user the shape stops (a spike's
        ramp-down) leaves nothing owed, and a request a stop cuts off
        (``--stop-timeout``) is owed again to the users that remain.
        """
        least = _STATE.get("least", 1)
        owed = [fn for fn in self.coverage if ENDED[_kind(fn)] + RUNNING[_kind(fn)] < least]
        fn: Any = owed[0] if owed else random.choice(self.tasks)
        kind = _kind(fn)

        def counted(user: ConstrainedLlmUser) -> None:
            RUNNING[kind] += 1
            ended = False
            try:
                fn(user)
                ended = True
            except Exception:  # the error report has it: it ended all the same
                ended = True
                raise
            finally:  # GreenletExit (a stop's kill) is no Exception: not ended, owed again
                RUNNING[kind] -= 1
                ENDED[kind] += ended

        return counted

    def on_stop(self) -> None:
        for client in self.clients:
            client.close()
            OPEN_CLIENTS.discard(client)

    @property
    def workload(self) -> Workload:
        return _STATE["workload"]  # type: ignore[no-any-return]

    @tag("constrained")
    @task(6)
    def constrained(self) -> None:
        self._generate(self.workload.constrained())

    @tag("unconstrained")
    @task(4)
    def unconstrained(self) -> None:
        self._generate(self.workload.unconstrained())

    @tag("regex")
    @task(1)
    def regex(self) -> None:
        self._generate(self.workload.regex())

    @tag("choice")
    @task(1)
    def choice(self) -> None:
        self._generate(self.workload.choice())

    @tag("cold")
    @task(1)
    def cold(self) -> None:
        self._generate(self.workload.cold())

    @tag("bad")
    @task(1)
    def bad(self) -> None:
        self._refused(self.workload.bad())

    @tag("openai")
    @task(3)
    def openai_chat(self) -> None:
        self._chat(self.workload.openai())

    def _generate(self, job: Job) -> None:
        start = time.perf_counter()
        first = last = None
        gaps: list[float] = []
        result = None
        error: BaseException | None = None
        try:
            for chunk in self.sdk.stream(job.prompt, constraint=job.constraint, max_tokens=job.max_tokens,
                                         require_complete=False):
                now = time.perf_counter()
                if chunk.text:
                    if last is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                if chunk.result is not None:
                    result = chunk.result
        except ClientError as err:  # an error RESULT raises after its final chunk: judged below
            error = err
        elapsed = time.perf_counter() - start
        if result is not None:
            reason = judge(job, result)
        else:
            reason = f"{type(error).__name__}: {error}"
        if reason is not None and job.label:
            reason = f"{reason} [{job.label}]"
        env = self.environment
        size = result.usage.completion_tokens if result is not None else 0
        _fire(env, "grpc", job.name, elapsed, size, reason)
        if first is not None:
            _fire(env, "ttft", job.tag, first - start)
        for gap in gaps:
            _fire(env, "itl", job.tag, gap)
        outcome = "failed" if reason is not None else (
            f"closed:{result.close_reason}" if result is not None and result.closed_early else "valid")
        OUTPUTS[job.tag][outcome] += 1

    def _chat(self, job: Job) -> None:
        """Stream one chat completion from the OpenAI-compatible endpoint; timed and judged as :meth:`_generate`."""
        if self.chat is None:  # excluded by tag without --openai-url (exclude_tags): never picked
            raise RuntimeError("the openai task ran without --openai-url")
        start = time.perf_counter()
        first = last = None
        gaps: list[float] = []
        stream = ChatStream()
        error: openai.OpenAIError | None = None
        try:
            for chunk in self.chat.chat.completions.create(**chat_request(job)):
                now = time.perf_counter()
                if stream.feed(chunk):
                    if last is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
        except openai.OpenAIError as err:  # a refusal, an error event mid-stream, a lost connection
            error = err
        elapsed = time.perf_counter() - start
        reason = judge_chat(job, stream) if error is None else f"{type(error).__name__}: {error}"
        if reason is not None and job.label:
            reason = f"{reason} [{job.label}]"
        env = self.environment
        _fire(env, "http", job.name, elapsed, stream.completion_tokens or 0, reason)
        if first is not None:
            _fire(env, "ttft", job.tag, first - start)
        for gap in gaps:
            _fire(env, "itl", job.tag, gap)
        OUTPUTS[job.tag][stream.outcome(reason)] += 1

    def _refused(self, job: Job) -> None:
        """Send a bad input on its own raw stream; it must end with exactly its status."""
        events: queue.Queue[tuple[Any, Any]] = queue.Queue()
        start = time.perf_counter()
        result: dict[str, Any] | None = None
        error: str | None = None
        self.raw.start_stream(callback=lambda result, error: events.put((result, error)))
        try:
            self.raw.async_stream_infer(MODEL, job.inputs or [], enable_empty_final_response=True)
            while True:
                res, err = events.get(timeout=120)
                if err is not None:
                    error = str(err)
                    break
                if res.as_numpy("RESULT") is not None:
                    result = json.loads(res.as_numpy("RESULT").reshape(-1)[0])
                if res.get_response().parameters["triton_final_response"].bool_param:
                    break
        except queue.Empty:
            error = "no final response within 120 s"
        finally:
            self.raw.stop_stream()
        reason = judge_refusal(job, result, error)
        _fire(self.environment, "grpc", job.name, time.perf_counter() - start, 0, reason)
        OUTPUTS[job.tag]["refused as expected" if reason is None else "failed"] += 1


def _counted(runner: Runner, least: int, now: float) -> bool:
    """Whether a run with ``--min-per-kind`` ends now (past ``-t``): every kind in the mix has its count.

    A kind still short at ``--deadline`` fails the run (exit status 1).
    """
    mix = {_kind(fn) for fn in ConstrainedLlmUser.tasks}  # the tasks left after --tags/--exclude-tags
    short = kinds_short(ENDED, mix, least)
    if not short:
        ended = {kind: ENDED[kind] for kind in sorted(mix)}
        print(f"loadtest: every kind ended {least} or more requests after {now:.0f} s: {ended}; stopping")
        return True
    if now >= _STATE["deadline_s"]:
        print(f"loadtest: --deadline {_STATE['deadline_s']} s reached with kinds short of {least} requests: "
              f"{short}; stopping, failed", file=sys.stderr)
        runner.environment.process_exit_code = 1
        return True
    return False


class SelectedShape(LoadTestShape):
    """``--shape`` over locust's own ``-u`` (peak users), ``-r`` and ``-t`` (default 60 s).

    With ``--min-per-kind``, ``-t`` is the shape's length and the least run
    time: the shape then holds its last level until :func:`_counted`.
    """

    reuse_parameters = True

    def tick(self) -> tuple[int, float] | None:
        runner = self.runner
        if runner is None:  # locust sets it before the first tick
            raise RuntimeError("the shape ticked before locust gave it its runner")
        opts: Any = runner.environment.parsed_options
        if _STATE.get("bounded"):  # --max-requests
            return None
        now, total = self.get_run_time(), float(opts.run_time or 60)
        counting = bool(opts.min_per_kind)
        if counting and now >= total and _counted(runner, opts.min_per_kind, now):
            return None
        return shape_tick(opts.shape, now, total, int(opts.num_users or 1), float(opts.spawn_rate or 1),
                          hold=counting)
