"""Request validation and prompt tokenization (the logic of the ``preprocessing`` model).

Every rejection is an :class:`~grammar_backend.errors.InvalidArgument`
naming the request field and the reason; the constraint is validated here
(spec and meta-schema), before it can reach a compiler.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import contract
from contract.errors import ConfigError, InvalidArgument, ServingError, status_of
from contract.reasoning import Reasoning, check_markers, reasoning_from_json
from grammar_backend.errors import ConstraintError
from grammar_backend.fidelity import validator_for
from grammar_backend.lru import Lru
from grammar_backend.spec import ConstraintSpec, SpecLimits, parse_constraint, validated_constraint

#: How a request becomes prompt tokens: ``chat`` applies the tokenizer's chat template to MESSAGES (PROMPT is
#: one user message); ``plain`` passes PROMPT through as text (with the tokenizer's own special tokens, e.g.
#: BOS) and refuses MESSAGES: for base checkpoints, which have no template.
PROMPT_FORMATS = ("chat", "plain")
#: The largest MAX_TOKENS a request may ask for, unless configured: the serving bound has this one home.
#: The served value is ``MAX_TOKENS_LIMIT`` (deploy/values.json, rendered into ``max_tokens_limit``);
#: ``llm`` trusts it and checks only the engine's context (prompt + max_tokens <= max_seq_len).
DEFAULT_MAX_TOKENS_LIMIT: Final = 1024


@dataclass(frozen=True)
class PreprocessConfig:
    """Parameters of the ``preprocessing`` model.

    ``tokenizer`` is the model folder (its tokenizer and chat template);
    ``max_tokens_limit`` bounds MAX_TOKENS (the one serving bound, :data:`DEFAULT_MAX_TOKENS_LIMIT`);
    ``default_max_tokens`` applies when absent;
    ``prompt_format`` is one of :data:`PROMPT_FORMATS`;
    ``reasoning_start``/``reasoning_end`` are the model's thinking markers
    (render values ``REASONING_START``/``REASONING_END``; None: the model does
    not reason): with them every request has a thinking section unless it
    says ``reasoning: false`` (:func:`contract.reasoning.check_reasoning`);
    a constraint larger than ``heavy_constraint_bytes`` and not seen before
    is checked in the heavy lane (:meth:`Preprocessor.heavy`), where at most
    ``heavy_queue`` wait (then RESOURCE_EXHAUSTED), by a child process
    (:mod:`pipeline.checker`) that may use ``heavy_cpu_s`` CPU seconds a check.
    """

    tokenizer: str
    prompt_format: str = "chat"
    max_prompt_tokens: int = 4096
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    default_max_tokens: int = 256
    max_payload_bytes: int = contract.MAX_CONSTRAINT_BYTES
    max_depth: int = contract.MAX_CONSTRAINT_DEPTH
    reasoning_start: str | None = None
    reasoning_end: str | None = None
    heavy_constraint_bytes: int = contract.HEAVY_CONSTRAINT_BYTES
    heavy_queue: int = 16
    heavy_cpu_s: float = 30.0

    def __post_init__(self) -> None:
        if self.heavy_constraint_bytes < 0 or self.heavy_queue < 1 or not self.heavy_cpu_s > 0:
            raise ConfigError("preprocessing: need heavy_constraint_bytes >= 0, heavy_queue >= 1 and heavy_cpu_s > 0, "
                              f"got {self.heavy_constraint_bytes}, {self.heavy_queue} and {self.heavy_cpu_s}")
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise ConfigError("preprocessing: reasoning_start needs reasoning_end (REASONING_END)")
        if self.reasoning_end is not None:
            try:
                check_markers(self.reasoning_start or "", self.reasoning_end, "preprocessing.reasoning")
            except contract.ContractError as err:
                raise ConfigError(str(err)) from err
        if not 0 < self.default_max_tokens <= self.max_tokens_limit:
            raise ConfigError("preprocessing: need 0 < default_max_tokens <= max_tokens_limit")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ConfigError(f"preprocessing: prompt_format must be one of {', '.join(PROMPT_FORMATS)}, "
                              f"got {self.prompt_format!r}")

    @property
    def reasoning(self) -> Reasoning | None:
        """The model's default thinking section (None: requests name their own markers)."""
        if self.reasoning_end is None:
            return None
        return Reasoning(end=self.reasoning_end, start=self.reasoning_start or "")


@dataclass(frozen=True)
class RawRequest:
    """The ensemble's request fields, as received (None = absent)."""

    prompt: bytes | None = None
    messages: bytes | None = None
    grammar_type: bytes | None = None
    grammar: bytes | None = None
    grammar_options: bytes | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[bytes, ...] = ()
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_p: float | None = None
    reasoning: bytes | None = None
    logprobs: int | None = None
    draft_tokens: int | None = None


@dataclass(frozen=True)
class GenerationParams:
    """Validated generation parameters, passed to ``llm`` and ``postprocessing`` as JSON.

    ``seed`` is always set: the request's, or a fresh one drawn here for a
    request without one (so unseeded requests differ, and RESULT ``seed``
    says which seed replays the output).  ``logprobs``: None (off) or how
    many alternatives to report per output token (:func:`contract.check_logprobs`).
    ``draft_tokens``: None (the engine's default) or the most prompt-lookup
    draft tokens a step may feed (:func:`contract.check_draft_tokens`).
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    constraint: dict[str, str] | None = field(default=None)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    reasoning: Reasoning | None = None
    logprobs: int | None = None
    draft_tokens: int | None = None

    def to_json(self) -> str:
        """Serialize for the REQUEST tensor (``reasoning`` only when the request has a thinking section,
        ``logprobs`` and ``draft_tokens`` only when it sets them)."""
        doc: dict[str, Any] = {
            "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "seed": self.seed, "stop": list(self.stop), "constraint": self.constraint,
            **{name: getattr(self, name) for name in contract.PENALTY_FIELDS}}
        if self.reasoning is not None:
            doc["reasoning"] = self.reasoning.as_dict()
        if self.logprobs is not None:
            doc["logprobs"] = self.logprobs
        if self.draft_tokens is not None:
            doc["draft_tokens"] = self.draft_tokens
        return json.dumps(doc, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> GenerationParams:
        """Inverse of :meth:`to_json`.

        Raises
        ------
        RejectedRequest
            ``text`` is :func:`rejection_json` of a request preprocessing refused.
        """
        doc = json.loads(text)
        rejected = doc.get("rejected")
        if rejected is not None:
            raise RejectedRequest(rejected["message"], rejected["status"])
        reasoning = doc.get("reasoning")
        logprobs = doc.get("logprobs")
        drafts = doc.get("draft_tokens")
        return cls(
            max_tokens=int(doc["max_tokens"]), temperature=float(doc["temperature"]), top_p=float(doc["top_p"]),
            top_k=int(doc["top_k"]), seed=int(doc["seed"]), stop=tuple(doc["stop"]), constraint=doc["constraint"],
            **{name: float(doc[name]) for name in contract.PENALTY_FIELDS},
            reasoning=None if reasoning is None else Reasoning(**reasoning),
            logprobs=None if logprobs is None else int(logprobs),
            draft_tokens=None if drafts is None else int(drafts),
        )


class RejectedRequest(ServingError):
    """A request that preprocessing refused, as ``llm`` receives it (status kept)."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.status = status


def rejection_json(err: BaseException) -> str:
    """The REQUEST tensor of a refused request: ``llm`` answers it with an error RESULT.

    Preprocessing never sends a Triton error response (see
    :mod:`pipeline.postprocess`): the refusal travels as data through
    ``llm`` and ``postprocessing`` to the client's final RESULT.
    """
    return json.dumps({"rejected": {"status": status_of(err), "message": str(err)}}, ensure_ascii=False)


def _text(name: str, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidArgument(name, f"not valid UTF-8 at byte {err.start}") from err


def parse_messages(raw: RawRequest) -> list[dict[str, str]]:
    """The chat messages of a request (PROMPT becomes one user message)."""
    if (raw.prompt is None) == (raw.messages is None):
        raise InvalidArgument("prompt", "exactly one of PROMPT and MESSAGES is required")
    if raw.prompt is not None:
        text = _text("prompt", raw.prompt)
        if not text.strip():
            raise InvalidArgument("prompt", "is empty")
        return [{"role": "user", "content": text}]
    try:
        doc = json.loads(_text("messages", raw.messages or b""))
    except json.JSONDecodeError as err:
        raise InvalidArgument("messages", f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from err
    except RecursionError as err:
        raise InvalidArgument("messages", "nested too deeply (expected an array of {role, content})") from err
    if not isinstance(doc, list) or not doc:
        raise InvalidArgument("messages", "must be a non-empty JSON array of {role, content}")
    for i, msg in enumerate(doc):
        if not isinstance(msg, dict) or not {"role", "content"} <= set(msg) <= set(contract.MESSAGE_KEYS):
            raise InvalidArgument(f"messages[{i}]", "must be an object with role and content (and optionally name)")
        if msg["role"] not in contract.MESSAGE_ROLES:
            raise InvalidArgument(f"messages[{i}].role",
                                  f"must be one of {', '.join(contract.MESSAGE_ROLES)}, got {msg['role']!r}")
        for key in ("content", "name"):
            if key in msg and not isinstance(msg[key], str):
                raise InvalidArgument(f"messages[{i}].{key}", "must be a string")
        _check_encodable(f"messages[{i}].content", msg["content"])
    return doc


def _check_encodable(name: str, text: str) -> None:
    """JSON escapes can spell lone surrogates (``"\\ud800"``), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidArgument(name, f"contains an unpaired surrogate (\\u{ord(text[err.start]):04x}) at "
                                    f"character {err.start}") from err


#: Constraints a preprocessing instance has refused, by a digest of their raw bytes: the refusal of
#: the same payload again costs its hash instead of its parse and checks (a 1.5 MB schema: 2 ms
#: against 0.4 s, timed alone: docs/benchmarks.md), so a client retrying a bad huge schema cannot
#: hold the instance.
_REFUSED: Lru[bytes, InvalidArgument] = Lru(1024)
#: Large constraints the heavy lane's child accepted (:mod:`pipeline.checker`), as their wire form
#: (kind, payload, options): the request then completes from it without a check, and the same constraint
#: again is served on the stub's thread, not queued behind new large ones.  Few: each may hold 2 MB.
_PASSED: Lru[bytes, tuple[str, str, str]] = Lru(32)


def _constraint_digest(kind: str, payload: bytes, options: bytes | None, limits: SpecLimits) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in (kind.encode(), payload, options or b"", f"{limits.max_payload_bytes}:{limits.max_depth}".encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class RequestConstraint:
    """A request's constraint fields as received, not yet checked (see :func:`check_constraint`)."""

    kind: str
    payload: bytes
    options: bytes | None
    limits: SpecLimits
    digest: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", _constraint_digest(self.kind, self.payload, self.options, self.limits))

    @property
    def size(self) -> int:
        """Bytes of payload and options: what the checks' cost grows with."""
        return len(self.payload) + len(self.options or b"")

    @property
    def seen(self) -> bool:
        """Whether this process checked the same bytes before (either verdict, as far as it remembers)."""
        return _PASSED.get(self.digest) is not None or _REFUSED.get(self.digest) is not None


def check_constraint(constraint: RequestConstraint) -> ConstraintSpec:
    """The request's constraint, validated (spec, meta-schema, the post-validator it will need).

    A verdict recorded before is reused: a refusal from :data:`_REFUSED`
    without a parse, an acceptance by the heavy lane's child from
    :data:`_PASSED` without a check.

    Raises
    ------
    InvalidArgument
        Naming the field and the reason.
    """
    known = _REFUSED.get(constraint.digest)
    if known is not None:
        # The same refusal again; the stub's thread and the heavy lane's may raise the one object at
        # once, which is harmless: only its message and status are read.
        raise known.with_traceback(None)
    passed = _PASSED.get(constraint.digest)
    if passed is not None:
        return validated_constraint(*passed)
    try:
        spec = parse_constraint(constraint.kind, constraint.payload, constraint.options, constraint.limits)
        if spec.kind.value == "json_schema":
            # The post-validator postprocessing will need: built now so a schema it
            # cannot use (an unresolvable or remote $ref) is refused before any token.
            validator_for(spec.document, checked=True)
    except InvalidArgument as err:
        _REFUSED.put(constraint.digest, err)
        raise
    return spec


def check_reply(constraint: RequestConstraint) -> tuple[str, str, str, str]:
    """The heavy lane child's verdict on ``constraint``: ``("ok", kind, payload, options)`` (the checked wire
    form) or ``("refused", field, reason, "")``; plain strings, so no exception type crosses the pipe."""
    try:
        spec = check_constraint(constraint)
    except InvalidArgument as err:
        return "refused", err.field, err.reason, ""
    wire = spec.wire()
    return "ok", wire["kind"], wire["payload"], wire["options"]


def record_check(constraint: RequestConstraint, reply: tuple[str, ...]) -> None:
    """Remember the child's verdict (:func:`check_reply`), so :func:`check_constraint` answers from it."""
    if reply[0] == "ok":
        _PASSED.put(constraint.digest, (reply[1], reply[2], reply[3]))
    else:
        _REFUSED.put(constraint.digest, ConstraintError(reply[1], reply[2]))


def parse_params(raw: RawRequest, config: PreprocessConfig) -> tuple[GenerationParams, ConstraintSpec | None]:
    """Validate sampling parameters and the constraint."""
    params, constraint = parse_fields(raw, config)
    return with_constraint(params, constraint)


def parse_fields(raw: RawRequest, config: PreprocessConfig) -> tuple[GenerationParams, RequestConstraint | None]:
    """Validate sampling parameters; gather the constraint's fields, unchecked (:func:`with_constraint` checks them).

    Raises
    ------
    InvalidArgument
        Naming the field and the reason.
    """
    max_tokens = config.default_max_tokens if raw.max_tokens is None else raw.max_tokens
    if not 1 <= max_tokens <= config.max_tokens_limit:
        raise InvalidArgument("max_tokens", f"must be in 1..{config.max_tokens_limit}, got {max_tokens}")
    temperature = 0.0 if raw.temperature is None else raw.temperature
    top_p = 1.0 if raw.top_p is None else raw.top_p
    top_k = 0 if raw.top_k is None else raw.top_k
    if len(raw.stop) > contract.MAX_STOP_STRINGS:  # before decoding any of them
        raise InvalidArgument("stop", f"at most {contract.MAX_STOP_STRINGS} stop strings, got {len(raw.stop)}")
    stop = tuple(_text(f"stop[{i}]", s) for i, s in enumerate(raw.stop))
    penalties = {name: neutral if getattr(raw, name) is None else getattr(raw, name)
                 for name, neutral in contract.PENALTY_FIELDS.items()}
    try:
        contract.check_sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=raw.seed, stop=stop,
                                **penalties)
        logprobs = contract.check_logprobs(raw.logprobs)
        drafts = contract.check_draft_tokens(raw.draft_tokens, penalties=penalties, logprobs=logprobs)
    except contract.ContractError as err:
        raise InvalidArgument(err.field, err.reason) from err
    try:
        reasoning = reasoning_from_json(raw.reasoning or b"", config.reasoning)
    except contract.ContractError as err:
        raise InvalidArgument(err.field, err.reason) from err
    constraint = None
    kind = _text("grammar_type", raw.grammar_type) if raw.grammar_type else ""
    if kind:
        limits = SpecLimits(max_payload_bytes=config.max_payload_bytes, max_depth=config.max_depth)
        constraint = RequestConstraint(kind, raw.grammar or b"", raw.grammar_options, limits)
    elif raw.grammar or raw.grammar_options:
        raise InvalidArgument("grammar_type", "is required when GRAMMAR or GRAMMAR_OPTIONS is given")
    elif reasoning is not None and reasoning.max_reasoning_tokens is not None:
        # Without a constraint no grammar state exists to count the thinking and force its end.
        raise InvalidArgument("reasoning.max_reasoning_tokens", "needs a constraint (the grammar side forces the "
                                                                "end marker); without one the output is only split")
    # Unseeded is random: a fresh seed per request (a fixed default made every unseeded request at a
    # temperature above 0 the same), reported in RESULT ``seed`` so the output can be replayed.
    seed = secrets.randbelow(contract.SEED_LIMIT) if raw.seed is None else raw.seed
    params = GenerationParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        seed=seed, stop=stop, constraint=None, **penalties,
        reasoning=reasoning, logprobs=logprobs, draft_tokens=drafts,
    )
    return params, constraint


def with_constraint(params: GenerationParams,
                    constraint: RequestConstraint | None) -> tuple[GenerationParams, ConstraintSpec | None]:
    """``params`` with ``constraint`` checked (:func:`check_constraint`) and in its wire form.

    Raises
    ------
    InvalidArgument
        Naming the field and the reason.
    """
    if constraint is None:
        return params, None
    spec = check_constraint(constraint)
    if params.reasoning is not None:
        # It rides with the constraint: the grammar side keeps the thinking state.
        spec = dataclasses.replace(spec, options=dataclasses.replace(spec.options, reasoning=params.reasoning))
    # Every kind carries its options: the decoding policies (on_budget,
    # on_repeat) apply to all of them.  Later stages trust this form.
    return dataclasses.replace(params, constraint=spec.wire()), spec


@dataclass(frozen=True)
class Pending:
    """A request checked and tokenized but for its constraint (:meth:`Preprocessor.prepare`)."""

    ids: list[int]
    params: GenerationParams
    constraint: RequestConstraint | None


class Preprocessor:
    """Validates a request and tokenizes its prompt (with the model's chat template, or as plain text).

    Parameters
    ----------
    config : PreprocessConfig
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer (with its chat template unless ``config.prompt_format`` is ``plain``).

    Raises
    ------
    ConfigError
        ``prompt_format`` is ``chat`` and the tokenizer has no chat template: refused
        at load, with what to add, rather than failing every request.
    """

    def __init__(self, config: PreprocessConfig, tokenizer: Any) -> None:
        if config.prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"preprocessing: the tokenizer of {config.tokenizer!r} has no chat template. Add one (a "
                "chat_template.jinja file, or chat_template in tokenizer_config.json), or serve it as a base "
                "model with PROMPT_FORMAT=plain (PROMPT is passed through as text; MESSAGES is refused)")
        self.config = config
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        self._special = frozenset(int(i) for i, t in decoder.items() if getattr(t, "special", False))
        default = config.reasoning
        if default is not None:
            try:
                self.check_markers(default)
            except InvalidArgument as err:
                raise ConfigError(f"preprocessing: {err}") from err

    def check_markers(self, reasoning: Reasoning) -> None:
        """Refuse markers that hold one of the tokenizer's special tokens.

        The output text leaves special tokens out (the detokenizer skips
        them), so such a marker would never be found in the text, while the
        grammar side, which masks special tokens while thinking, could never
        see it written either.

        Raises
        ------
        InvalidArgument
            Naming ``reasoning.start`` or ``reasoning.end``.
        """
        for name, marker in (("start", reasoning.start), ("end", reasoning.end)):
            if marker and self._special:
                ids = self.tokenizer.encode(marker, add_special_tokens=False)
                found = [int(t) for t in ids if int(t) in self._special]
                if found:
                    raise InvalidArgument(f"reasoning.{name}", f"{marker!r} holds the special token "
                                          f"{self.tokenizer.convert_ids_to_tokens(found[0])!r}, which the output "
                                          "text leaves out")

    @classmethod
    def from_config(cls, config: PreprocessConfig) -> Preprocessor:
        """Load the tokenizer of the local model folder ``config.tokenizer``."""
        from transformers import AutoTokenizer

        return cls(config, AutoTokenizer.from_pretrained(config.tokenizer, local_files_only=True))

    def heavy(self, pending: Pending) -> bool:
        """Whether ``pending``'s constraint goes to the heavy lane (``model_repository/preprocessing``).

        A constraint larger than ``heavy_constraint_bytes`` that this process
        has not checked before: its checks may cost seconds (a 1.9 MB schema's
        meta-schema check about 4 s), and requests behind it must not wait.
        """
        c = pending.constraint
        return c is not None and c.size > self.config.heavy_constraint_bytes and not c.seen

    def prepare(self, raw: RawRequest) -> Pending:
        """Check every field but the constraint and tokenize the prompt (the stub's own thread: the tokenizer).

        Raises
        ------
        InvalidArgument
            Naming the field and the reason.
        """
        messages = parse_messages(raw)
        if self.config.prompt_format == "plain" and raw.messages is not None:
            raise InvalidArgument("messages", "this model has no chat template (prompt format plain): send "
                                              "PROMPT, which is passed through as text")
        params, constraint = parse_fields(raw, self.config)
        if params.reasoning is not None:
            self.check_markers(params.reasoning)
        if self.config.prompt_format == "plain":
            ids = self.tokenizer(messages[0]["content"], add_special_tokens=True)["input_ids"]
            where = "as plain text"
        else:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            where = "after the chat template"
        if hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        ids = [int(t) for t in ids]
        if len(ids) > self.config.max_prompt_tokens:
            raise InvalidArgument("prompt", f"is {len(ids)} tokens {where}; the limit is {self.config.max_prompt_tokens}")
        return Pending(ids, params, constraint)

    def complete(self, pending: Pending, check: Callable[[RequestConstraint], None] | None = None,
                 ) -> tuple[list[int], GenerationParams]:
        """Check ``pending``'s constraint; thread-safe (the heavy lane calls it; it never uses the tokenizer).

        ``check``: how a :meth:`heavy` constraint is checked first (the heavy
        lane's :meth:`pipeline.checker.Checker.check`, which records its
        verdict); every other constraint is checked here.

        Raises
        ------
        InvalidArgument
            Naming the field and the reason.
        """
        if check is not None and pending.constraint is not None and self.heavy(pending):
            check(pending.constraint)
        params, _ = with_constraint(pending.params, pending.constraint)
        return pending.ids, params

    def __call__(self, raw: RawRequest) -> tuple[list[int], GenerationParams]:
        """Return the prompt token ids and the validated parameters (:meth:`prepare`, then :meth:`complete`).

        Raises
        ------
        InvalidArgument
            Naming the field and the reason.
        """
        return self.complete(self.prepare(raw))
