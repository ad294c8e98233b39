"""What the load test sends and how every answer is judged (no locust, no gevent: unit-tested as is).

A :class:`Job` is one request of a task kind (its locust tag); :class:`Workload`
builds them; :func:`judge` turns a final :class:`client.Result` into ``None``
(success) or the failure reason locust records.  Every success is checked
against its constraint here, independently of the server's own report:
JSON is parsed and validated with ``jsonschema`` (Draft 2020-12, formats
checked), a regex output must match it, a choice must be one of them.

Schemas: the project's own (``loadtest/schemas``: extraction and tool-call
arguments) and a seeded sample of MaskBench schemas read by path from
``--data-dir`` (default ``../shared/data/maskbench-dev``), kept only when the
server takes them, xgrammar compiles them, and the fidelity table lists no
keyword xgrammar leaves unenforced: a load test's failures must be the
server's, not known gaps (``bench/maskbench.py`` measures those).

The ``openai`` task sends JSON jobs to the OpenAI-compatible endpoint
(``--openai-url``) through the ``openai`` package: :func:`chat_request` is
its strict ``json_schema`` request (schemas the endpoint's strict mode takes:
:func:`strict_ok`), :class:`ChatStream` reads its chunks and
:func:`judge_chat` judges them as :func:`judge` does a gRPC result, plus
OpenAI's stream shape and the endpoint's report.  Without ``--openai-url``
the task is excluded (:func:`exclude_tags`): the gRPC mix is unchanged.
"""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import jsonschema
import numpy as np
import tritonclient.grpc as grpcclient

from client import Constraint, Result
from client.errors import InvalidConstraint
from client.sdk import DEFAULT_MODEL

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionChunk

REPO: Final = Path(__file__).resolve().parents[1]
OWN_SCHEMAS: Final = REPO / "loadtest" / "schemas"
DEFAULT_DATA: Final = REPO.parent / "shared" / "data" / "maskbench-dev"

#: The task over the OpenAI-compatible endpoint: excluded unless ``--openai-url`` is given.
OPENAI_TAG: Final = "openai"
#: Task kinds; each is a locust tag, so ``--tags``/``--exclude-tags`` select them.
TAGS: Final = ("constrained", "unconstrained", "regex", "choice", "cold", "bad", OPENAI_TAG)

#: Schemas longer than this (compact JSON characters) are left out of the
#: sample: their prompts run to thousands of tokens, and this measures decoding.
MAX_SCHEMA_CHARS: Final = 2500

_OWN_PROMPTS: Final[dict[str, str]] = {
    "invoice_extraction": "Extract the invoice: ACME GmbH, invoice DE-20931 of 2024-03-14, 3 widgets at 4.50 EUR "
                          "and 1 gadget at 12 EUR, total 25.50 EUR.",
    "tool_call_search": "Call search_flights for two adults flying from Lisbon (LIS) to Tokyo (HND) "
                        "on 2025-06-02, economy.",
    "contact_extraction": "Extract the contact: Dr. Ana Ruiz, ana.ruiz@example.org, +34 600 123 456, "
                          "works at Nimbus Labs.",
    # Closed, all required, nullable eta: OpenAI's strict subset, so the openai task's schema could also
    # be sent to OpenAI itself.
    "order_status": "Report the order: ORD-104233 shipped with 3 items, arriving on 2025-07-14.",
}
_MASKBENCH_PROMPT: Final = "Produce one realistic JSON instance of this schema: {schema}"

_REGEX: Final = (r"[A-Z][a-z]{2,9} [0-9]{1,3} (apples|pears)", "Count some fruit, like 'Anna 12 apples'.")
_CHOICE: Final = (("positive", "negative", "neutral"), "Sentiment of 'the service was fine, nothing more'?")


@dataclass(frozen=True)
class Job:
    """One request.

    Attributes
    ----------
    tag : str
        Its task kind (one of :data:`TAGS`).
    name : str
        The locust entry it is reported under.
    prompt : str
    constraint : Constraint or None
    max_tokens : int
    schema : dict or None
        The JSON Schema its output must satisfy (JSON jobs).
    inputs : list of tritonclient InferInput or None
        Raw tensors of a bad input (sent as is, bypassing the SDK's checks).
    expect : tuple of (str, str) or None
        A bad input's exact status and the start of its error message.
    label : str
        What the failure reasons name: the schema of a JSON job.
    """

    tag: str
    name: str
    prompt: str = ""
    constraint: Constraint | None = None
    max_tokens: int = 64
    schema: dict[str, Any] | None = None
    inputs: list[grpcclient.InferInput] | None = field(default=None, compare=False)
    expect: tuple[str, str] | None = None
    label: str = ""


def _tensor(name: str, datatype: str, values: Any) -> grpcclient.InferInput:
    array = np.asarray(values, dtype=np.object_ if datatype == "BYTES" else None)
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def bad_inputs() -> list[tuple[str, list[grpcclient.InferInput], str, str]]:
    """(name, raw tensors, exact status, error prefix) of requests the server must refuse, for that request only."""
    prompt = _tensor("PROMPT", "BYTES", [b"Say hi."])
    json_schema = _tensor("GRAMMAR_TYPE", "BYTES", [b"json_schema"])
    return [
        ("bad:max_tokens", [prompt, _tensor("MAX_TOKENS", "INT32", np.array([0], np.int32))],
         "INVALID_ARGUMENT", "max_tokens: must be in 1.."),
        ("bad:schema_json", [prompt, json_schema, _tensor("GRAMMAR", "BYTES", [b"{nope"])],
         "INVALID_ARGUMENT", "grammar: invalid JSON at line 1 column 2"),
        ("bad:schema_type", [prompt, json_schema, _tensor("GRAMMAR", "BYTES", [b'{"type": "objekt"}'])],
         "INVALID_ARGUMENT", "grammar#/type: "),
        ("bad:regex", [prompt, _tensor("GRAMMAR_TYPE", "BYTES", [b"regex"]), _tensor("GRAMMAR", "BYTES", [b"(a"])],
         "INVALID_ARGUMENT", "grammar: xgrammar cannot compile this regex"),
        ("bad:option", [prompt, _tensor("GRAMMAR_TYPE", "BYTES", [b"regex"]), _tensor("GRAMMAR", "BYTES", [b"a+"]),
                        _tensor("GRAMMAR_OPTIONS", "BYTES", [b'{"on_budget": "stop"}'])],
         "INVALID_ARGUMENT", "grammar_options.on_budget: must be one of"),
        ("bad:utf8", [_tensor("PROMPT", "BYTES", [b"\xff\xfe"])], "INVALID_ARGUMENT", "prompt: not valid UTF-8"),
    ]


class SchemaCheck:
    """Decides, in process and with the model's tokenizer, whether a schema belongs in the load.

    Usable: the server takes it, xgrammar compiles it and enforces every
    keyword (the fidelity table), and its shortest valid instance needs at
    most half the budget, so a truncated output is a failure of the
    server's closing, never a budget that no output could fit.

    Parameters
    ----------
    tokenizer_dir : Path
        The served model's folder (its tokenizer: token counts must match).
    max_tokens : int
        The load's budget per request.
    """

    def __init__(self, tokenizer_dir: Path, max_tokens: int) -> None:
        import xgrammar as xgr

        from grammar_backend.closing import Closer
        from grammar_backend.tokenizer import load_tokenizer

        info = load_tokenizer(str(tokenizer_dir)).info
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._closer = Closer(info)
        self.max_tokens = max_tokens

    def usable(self, schema: dict[str, Any]) -> bool:
        """Whether ``schema`` passes every check above."""
        import xgrammar as xgr

        from grammar_backend.compile import compile_spec
        from grammar_backend.errors import GrammarError
        from grammar_backend.fidelity import unenforced_keywords
        from grammar_backend.spec import parse_constraint

        try:
            Constraint.json_schema(schema)
            spec = parse_constraint("json_schema", json.dumps(schema))
            if unenforced_keywords(schema, strict_mode=False):
                return False
            shortest = self._closer.complete(xgr.GrammarMatcher(compile_spec(self._compiler, spec)))
        except (InvalidConstraint, GrammarError, RuntimeError):
            return False
        return shortest is not None and len(shortest) + 1 <= self.max_tokens // 2


def strict_ok(schema: dict[str, Any]) -> bool:
    """Whether the endpoint's strict mode takes ``schema`` (every keyword enforced while decoding):
    :func:`openai_api.strict.check_strict`."""
    # Imported here: the gRPC-only load test needs none of the OpenAI endpoint's modules.
    from openai_api.errors import BadRequest
    from openai_api.strict import check_strict

    try:
        check_strict(schema, "schema")
    except BadRequest:
        return False
    return True


def maskbench_sample(data: Path, count: int, seed: int, check: SchemaCheck, *,
                     strict: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """``count`` small (file name, schema) of ``data``, seeded, that ``check`` finds usable.

    ``strict``: only schemas the endpoint's strict mode takes (:func:`strict_ok`,
    tested before the costlier ``check``), in the same seeded order.
    """
    files = sorted(data.glob("*.json"))
    random.Random(seed).shuffle(files)
    out: list[tuple[str, dict[str, Any]]] = []
    for path in files:
        if len(out) == count:
            break
        schema = json.loads(path.read_text(encoding="utf-8")).get("schema")
        small = isinstance(schema, dict) and len(json.dumps(schema, separators=(",", ":"))) <= MAX_SCHEMA_CHARS
        if small and (not strict or strict_ok(schema)) and check.usable(schema):
            out.append((path.stem, schema))
    return out


class Workload:
    """Builds the jobs of every task kind.

    Parameters
    ----------
    schemas : sequence of (name, schema, prompt)
        The JSON jobs' schemas (own ones and a MaskBench sample).
    max_tokens : int
        Budget of every generating job.
    seed : int
        Seeds the choice of schema and prompt per job.
    strict : sequence of (name, schema, prompt)
        The ``openai`` task's schemas (OpenAI's strict mode takes them); empty
        when that task is off.
    """

    def __init__(self, schemas: Sequence[tuple[str, dict[str, Any], str]], max_tokens: int, seed: int = 0,
                 strict: Sequence[tuple[str, dict[str, Any], str]] = ()) -> None:
        if not schemas:
            raise ValueError("loadtest: no JSON schema to send")
        self.schemas = list(schemas)
        self.strict = list(strict)
        self.max_tokens = max_tokens
        self._rng = random.Random(seed)
        self._bad = bad_inputs()

    @classmethod
    def build(cls, data: Path | None, sample: int, max_tokens: int, check: SchemaCheck | None,
              seed: int = 0, *, openai: bool = False) -> Workload:
        """The own schemas plus ``sample`` MaskBench schemas of ``data``, all passing ``check``.

        ``openai``: also the ``openai`` task's schemas, the own ones that
        OpenAI's strict mode takes plus ``sample`` MaskBench schemas that it
        takes (few are strict, so they are sampled apart from the mix).
        ``check`` None (unit tests): the own schemas, unchecked, and no sample.
        """
        own = [(path.stem, json.loads(path.read_text(encoding="utf-8")), _OWN_PROMPTS[path.stem])
               for path in sorted(OWN_SCHEMAS.glob("*.json"))]
        if check is not None:
            own = [entry for entry in own if check.usable(entry[1])]
        schemas, strict = list(own), [entry for entry in own if openai and strict_ok(entry[1])]
        if check is not None and data is not None and sample:
            schemas += [(name, schema, _maskbench_prompt(schema))
                        for name, schema in maskbench_sample(data, sample, seed, check)]
            if openai:
                strict += [(name, schema, _maskbench_prompt(schema))
                           for name, schema in maskbench_sample(data, sample, seed, check, strict=True)]
        return cls(schemas, max_tokens, seed, strict)

    def constrained(self) -> Job:
        """A JSON Schema job (own or MaskBench)."""
        name, schema, prompt = self._rng.choice(self.schemas)
        return Job("constrained", "constrained", prompt, Constraint.json_schema(schema), self.max_tokens, schema,
                   label=name)

    def unconstrained(self) -> Job:
        """The baseline: free text, same budget, and the prompts of the JSON jobs (a MaskBench prompt
        holds its schema: hundreds of tokens to prefill), so the two kinds' time to first token differ
        by what the constraint costs, not by prompt length."""
        _, _, prompt = self._rng.choice(self.schemas)
        return Job("unconstrained", "unconstrained", prompt, None, self.max_tokens)

    def regex(self) -> Job:
        pattern, prompt = _REGEX
        return Job("regex", "regex", prompt, Constraint.regex(pattern), self.max_tokens)

    def choice(self) -> Job:
        choices, prompt = _CHOICE
        return Job("choice", "choice", prompt, Constraint.choice(list(choices)), self.max_tokens)

    def cold(self) -> Job:
        """A schema never seen before (a compile per request: the compile storm)."""
        key = f"k_{uuid.uuid4().hex[:12]}"
        schema = {"type": "object", "properties": {key: {"type": "integer", "minimum": 0},
                                                   "label": {"type": "string", "maxLength": 24}},
                  "required": [key, "label"], "additionalProperties": False}
        prompt = f"Give {key} a small number and a short label, as JSON."
        return Job("cold", "cold", prompt, Constraint.json_schema(schema), self.max_tokens, schema)

    def bad(self) -> Job:
        """A request the server must refuse with its exact status."""
        name, inputs, status, message = self._rng.choice(self._bad)
        return Job("bad", name, inputs=inputs, expect=(status, message))

    def openai(self) -> Job:
        """A JSON Schema job for the OpenAI-compatible endpoint (a schema that strict mode takes)."""
        if not self.strict:
            raise ValueError("loadtest: no schema for the openai task: none of the own or sampled schemas "
                             "passes OpenAI's strict mode (openai_api.strict)")
        name, schema, prompt = self._rng.choice(self.strict)
        return Job(OPENAI_TAG, OPENAI_TAG, prompt, Constraint.json_schema(schema), self.max_tokens, schema,
                   label=name)


def _maskbench_prompt(schema: dict[str, Any]) -> str:
    return _MASKBENCH_PROMPT.format(schema=json.dumps(schema, separators=(",", ":")))


SHAPES: Final = ("steady", "ramp", "spike")


def shape_tick(shape: str, now: float, total: float, users: int, rate: float, *,
               hold: bool = False) -> tuple[int, float] | None:
    """Users and spawn rate at ``now`` seconds of a ``total``-second run peaking at ``users`` (None: stop).

    ``steady``: all users throughout.  ``ramp``: from 1 to all over the first
    80 % of the run, then held (capacity is read from its history).
    ``spike``: a quarter of the users, all of them in the middle fifth, then
    a quarter again (spawned at once, a burst of new streams).  ``hold``:
    past ``total`` the shape keeps its last level instead of stopping (a run
    that ends on counts, ``--min-per-kind``: :func:`kinds_short`).
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    if now >= total:
        if not hold:
            return None
        now = total
    if shape == "ramp":
        return max(1, math.ceil(users * min(1.0, now / (0.8 * total)))), rate
    if shape == "spike":
        burst = 0.4 * total <= now < 0.6 * total
        return (users if burst else max(1, users // 4)), max(rate, float(users))
    return users, rate


def kinds_short(ended: Mapping[str, int], kinds: Iterable[str], least: int) -> dict[str, int]:
    """The kinds among ``kinds`` with fewer than ``least`` ended requests, with their counts.

    ``ended``: kind -> requests that ended, whatever their outcome (``ENDED``
    of the locustfile).  Empty: every kind has its count, and a run with
    ``--min-per-kind`` may end.
    """
    return {kind: n for kind in sorted(kinds) if (n := ended.get(kind, 0)) < least}


_FORMATS: Final = jsonschema.Draft202012Validator.FORMAT_CHECKER


def judge(job: Job, result: Result) -> str | None:
    """None when ``result`` is a success for ``job``; else the failure reason (short, groupable).

    A JSON output counts when it validates, whether the model finished it or
    the server closed it early (``on_budget``/``on_repeat``: valid, values
    possibly cut short); a truncated output is a failure.
    """
    if result.finish_reason == "error":
        return f"error {result.status}: {(result.error or '')[:80]}"
    if job.constraint is None:
        return None
    if not (result.complete or result.closed_early):
        return "stop string" if result.stop_string else "truncated"
    if job.schema is not None:
        return check_json(job.schema, result.text)
    if job.tag == "regex":
        return None if re.fullmatch(_REGEX[0], result.text) else "regex mismatch"
    if job.tag == "choice":
        return None if result.text in _CHOICE[0] else "not a choice"
    return None


def check_json(schema: dict[str, Any], text: str) -> str | None:
    """None when ``text`` is one JSON value valid against ``schema`` (Draft 2020-12, formats checked); else why."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return "not JSON"
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema, format_checker=_FORMATS).iter_errors(value))
    return None if error is None else f"invalid at {error.json_path}: {error.validator}"


def judge_refusal(job: Job, result: dict[str, Any] | None, error: str | None) -> str | None:
    """None when a bad input got exactly its expected status and message; else the reason."""
    if job.expect is None:
        raise ValueError(f"{job.name}: not a bad-input job")
    status, message = job.expect
    if error is not None:
        return f"in-band error instead of RESULT: {error[:80]}"
    if result is None:
        return "no RESULT"
    got = (result.get("finish_reason"), result.get("status"))
    if got != ("error", status):
        return f"expected error {status}, got {got}"
    if not str(result.get("error", "")).startswith(message):
        return f"unexpected message: {str(result.get('error'))[:80]}"
    return None


def openai_base_url(url: str) -> str | None:
    """``--openai-url`` checked: None when empty (the ``openai`` task is off), else the base URL without a final ``/``.

    Raises
    ------
    ValueError
        Not ``http(s)://HOST[:PORT]/v1`` (the client appends ``/chat/completions``).
    """
    if not url:
        return None
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as err:
        raise ValueError(f"--openai-url {url!r}: {err}") from err
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--openai-url {url!r}: must be http(s)://HOST:PORT/v1")
    if parts.path.rstrip("/") != "/v1" or parts.query or parts.fragment:
        raise ValueError(f"--openai-url {url!r}: the path must be /v1 (the client appends /chat/completions)")
    return url.rstrip("/")


def exclude_tags(exclude: Sequence[str] | None, tags: Sequence[str] | None, openai_url: str | None) -> list[str]:
    """The ``--exclude-tags`` of a run: as given, plus ``openai`` when there is no ``--openai-url``.

    Raises
    ------
    ValueError
        ``--tags`` asks for ``openai`` without ``--openai-url``.
    """
    if openai_url:
        return list(exclude or ())
    if tags and OPENAI_TAG in tags:
        raise ValueError(f"--tags {OPENAI_TAG}: needs --openai-url (the OpenAI-compatible endpoint's base URL, "
                         "e.g. http://127.0.0.1:8080/v1)")
    return [*(exclude or ()), OPENAI_TAG]


def schema_name(label: str) -> str:
    """``response_format.json_schema.name`` for a schema's label (1-64 of ``A-Za-z0-9_-``, as OpenAI's)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", label)[:64] or "schema"


def chat_request(job: Job) -> dict[str, Any]:
    """Keyword arguments of ``openai.OpenAI().chat.completions.create`` for an ``openai`` job.

    Its schema as a strict ``json_schema`` response format, its prompt as one
    user message (the gRPC jobs' prompt is one user turn too), greedy as the
    gRPC jobs, streamed with the usage chunk.

    Raises
    ------
    ValueError
        ``job`` has no schema.
    """
    if job.schema is None:
        raise ValueError(f"{job.name}: not a JSON job (no schema)")
    return {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": job.prompt}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": schema_name(job.label), "schema": job.schema, "strict": True}},
        "max_tokens": job.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class ChatStream:
    """What one streamed chat completion returned, read chunk by chunk.

    Attributes
    ----------
    text : str
        The content deltas joined.
    finish_reason : str or None
        From the chunk that has one.
    report : Any
        That chunk's extension object (``constrained_llm``: ``complete``,
        ``closed_early``, ``json``, ...), as sent.
    completion_tokens : int or None
        From the usage chunk.
    problem : str or None
        The first break of OpenAI's stream shape (a failure reason): a chunk
        after the usage chunk, usage beside choices, other than one choice
        per chunk, a chunk after the finish reason, a tool call.
    """

    text: str = ""
    finish_reason: str | None = None
    report: Any = None
    completion_tokens: int | None = None
    problem: str | None = None

    def feed(self, chunk: ChatCompletionChunk) -> str:
        """Take one chunk; returns its text delta (``""`` for none)."""
        from openai_api.request import EXTENSION

        if self.completion_tokens is not None:
            return self._broken("a chunk after the usage chunk")
        if chunk.usage is not None:
            if chunk.choices:
                return self._broken("usage on a chunk with choices")
            self.completion_tokens = chunk.usage.completion_tokens
            return ""
        if len(chunk.choices) != 1:
            return self._broken(f"{len(chunk.choices)} choices in a chunk")
        if self.finish_reason is not None:
            return self._broken("a chunk after the finish_reason")
        choice = chunk.choices[0]
        if choice.delta.tool_calls:
            return self._broken("a tool call in a json_schema response")
        text = choice.delta.content or ""
        self.text += text
        if choice.finish_reason is not None:
            self.finish_reason = choice.finish_reason
            self.report = (chunk.model_extra or {}).get(EXTENSION)
        return text

    def _broken(self, reason: str) -> str:
        self.problem = self.problem or reason
        return ""

    def outcome(self, reason: str | None) -> str:
        """The ``--outputs-json`` outcome of this stream judged ``reason``: failed, closed:REASON or valid."""
        if reason is not None:
            return "failed"
        if isinstance(self.report, dict) and self.report.get("closed_early") is True:
            return f"closed:{self.report.get('close_reason')}"
        return "valid"


def judge_chat(job: Job, stream: ChatStream) -> str | None:
    """None when a streamed chat completion is a success for ``job``; else the failure reason.

    The output as :func:`judge` checks a gRPC one (complete or closed early,
    then parsed and validated), and what OpenAI's shape adds: the stream's
    shape (:class:`ChatStream`), the usage chunk asked for, a
    ``finish_reason`` of ``stop`` or ``length`` that agrees with the report
    (a complete output stops), and the report's ``json`` verdict agreeing.

    Raises
    ------
    ValueError
        ``job`` has no schema.
    """
    from openai_api.request import EXTENSION

    if job.schema is None:
        raise ValueError(f"{job.name}: not a JSON job (no schema)")
    if stream.problem is not None:
        return stream.problem
    if stream.finish_reason is None:
        return "no finish_reason"
    if stream.completion_tokens is None:
        return "no usage chunk"
    if stream.finish_reason not in ("stop", "length"):
        return f"finish_reason {stream.finish_reason}"
    report = stream.report
    if not isinstance(report, dict):
        return f"no {EXTENSION} report"
    complete, closed = report.get("complete") is True, report.get("closed_early") is True
    if complete and stream.finish_reason != "stop":
        return f"complete but finish_reason {stream.finish_reason}"
    if not (complete or closed):
        return "stop string" if report.get("stop_string") is True else "truncated"
    reason = check_json(job.schema, stream.text)
    if reason is not None:
        return reason
    verdict = report.get("json")
    if not isinstance(verdict, dict):
        return f"report json {json.dumps(verdict)}"
    if (verdict.get("parsed"), verdict.get("valid")) != (True, True):
        return f"report json parsed={verdict.get('parsed')} valid={verdict.get('valid')}"
    return None
