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
"""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import jsonschema
import numpy as np
import tritonclient.grpc as grpcclient

from client import Constraint, Result
from client.errors import InvalidConstraint

REPO: Final = Path(__file__).resolve().parents[1]
OWN_SCHEMAS: Final = REPO / "loadtest" / "schemas"
DEFAULT_DATA: Final = REPO.parent / "shared" / "data" / "maskbench-dev"

#: Task kinds; each is a locust tag, so ``--tags``/``--exclude-tags`` select them.
TAGS: Final = ("constrained", "unconstrained", "regex", "choice", "cold", "bad")

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


def maskbench_sample(data: Path, count: int, seed: int, check: SchemaCheck) -> list[tuple[str, dict[str, Any]]]:
    """``count`` small (file name, schema) of ``data``, seeded, that ``check`` finds usable."""
    files = sorted(data.glob("*.json"))
    random.Random(seed).shuffle(files)
    out: list[tuple[str, dict[str, Any]]] = []
    for path in files:
        if len(out) == count:
            break
        schema = json.loads(path.read_text(encoding="utf-8")).get("schema")
        small = isinstance(schema, dict) and len(json.dumps(schema, separators=(",", ":"))) <= MAX_SCHEMA_CHARS
        if small and check.usable(schema):
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
    """

    def __init__(self, schemas: Sequence[tuple[str, dict[str, Any], str]], max_tokens: int, seed: int = 0) -> None:
        if not schemas:
            raise ValueError("loadtest: no JSON schema to send")
        self.schemas = list(schemas)
        self.max_tokens = max_tokens
        self._rng = random.Random(seed)
        self._bad = bad_inputs()

    @classmethod
    def build(cls, data: Path | None, sample: int, max_tokens: int, check: SchemaCheck | None,
              seed: int = 0) -> Workload:
        """The own schemas plus ``sample`` MaskBench schemas of ``data``, all passing ``check``.

        ``check`` None (unit tests): the own schemas, unchecked, and no sample.
        """
        schemas = [(path.stem, json.loads(path.read_text(encoding="utf-8")), _OWN_PROMPTS[path.stem])
                   for path in sorted(OWN_SCHEMAS.glob("*.json"))]
        if check is not None:
            schemas = [entry for entry in schemas if check.usable(entry[1])]
            if data is not None and sample:
                for name, schema in maskbench_sample(data, sample, seed, check):
                    prompt = _MASKBENCH_PROMPT.format(schema=json.dumps(schema, separators=(",", ":")))
                    schemas.append((name, schema, prompt))
        return cls(schemas, max_tokens, seed)

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


SHAPES: Final = ("steady", "ramp", "spike")


def shape_tick(shape: str, now: float, total: float, users: int, rate: float) -> tuple[int, float] | None:
    """Users and spawn rate at ``now`` seconds of a ``total``-second run peaking at ``users`` (None: stop).

    ``steady``: all users throughout.  ``ramp``: from 1 to all over the first
    80 % of the run, then held (capacity is read from its history).
    ``spike``: a quarter of the users, all of them in the middle fifth, then
    a quarter again (spawned at once, a burst of new streams).
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    if now >= total:
        return None
    if shape == "ramp":
        return max(1, math.ceil(users * min(1.0, now / (0.8 * total)))), rate
    if shape == "spike":
        burst = 0.4 * total <= now < 0.6 * total
        return (users if burst else max(1, users // 4)), max(rate, float(users))
    return users, rate


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
        try:
            value = json.loads(result.text)
        except json.JSONDecodeError:
            return "not JSON"
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(job.schema, format_checker=_FORMATS).iter_errors(value))
        return None if error is None else f"invalid at {error.json_path}: {error.validator}"
    if job.tag == "regex":
        return None if re.fullmatch(_REGEX[0], result.text) else "regex mismatch"
    if job.tag == "choice":
        return None if result.text in _CHOICE[0] else "not a choice"
    return None


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
