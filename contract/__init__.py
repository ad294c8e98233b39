"""The request contract: the one home of every rule a client and the server must agree on.

Dependency-free (standard library only), so the client SDK imports it
without xgrammar or torch, and every server layer imports the same values:
constraint kinds and which options apply to which kind, option values and
ranges, sampling fields and their ranges, the payload limit, and the names of
finish and close reasons.  The client checks requests with these functions
for early feedback; preprocessing checks them again as the authority (with
the same functions, so both answer the same for every value:
``tests/unit/test_contract.py``).  Each check raises :class:`ContractError`
naming the field; each layer re-raises it as its own error type.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = [
    "BACKENDS",
    "CLOSE_REASONS",
    "CONSTRAINT_KINDS",
    "DECODING_FLAGS",
    "DRAFT_EXCLUDED_PENALTIES",
    "FINISH_REASONS",
    "JSON_KINDS",
    "JSON_OBJECT_SCHEMA",
    "JSON_OPTION_KINDS",
    "JSON_OPTION_NAMES",
    "MAX_CHOICES",
    "MAX_CONSTRAINT_BYTES",
    "MAX_CONSTRAINT_DEPTH",
    "MAX_INDENT",
    "MAX_MAX_TOKENS",
    "MAX_MESSAGE_BYTES",
    "MAX_PENALTY",
    "MAX_REPETITION_PENALTY",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TEMPERATURE",
    "MAX_TOP_K",
    "MAX_TOP_LOGPROBS",
    "MAX_VALUE_RETRIES",
    "MAX_WHITESPACE_RUN",
    "MESSAGE_KEYS",
    "MESSAGE_ROLES",
    "OPTION_NAMES",
    "PENALTY_FIELDS",
    "POLICIES",
    "SEED_LIMIT",
    "TAG_WHITESPACE_RUN",
    "VALUE_RETRIES",
    "ContractError",
    "check_draft_tokens",
    "check_logprobs",
    "check_options",
    "check_sampling",
]

#: Every ``GRAMMAR_TYPE`` value.  What a complete output of each kind is:
#: ``json_schema``: one JSON document valid under the schema (``GRAMMAR``);
#: ``json_object``: one JSON object, any members (:data:`JSON_OBJECT_SCHEMA`;
#: never a bare string, number, array or literal); ``regex``: a full match of
#: the pattern (``.``, ``\d``, ``\w``, ``\s`` as ECMA-262 reads them, whichever
#: backend serves it: ``grammar_backend.regex_dialect``); ``ebnf``/``lark``: a sentence of the grammar; ``choice``:
#: exactly one of the listed strings; ``structural_tag``: free text whose
#: tagged segments match their schemas.
CONSTRAINT_KINDS: Final = ("json_schema", "json_object", "regex", "ebnf", "lark", "choice", "structural_tag")
#: The schema a ``json_object`` output satisfies (compiled, post-validated and
#: passed to TensorRT-LLM's native decoder as this text).
JSON_OBJECT_SCHEMA: Final = '{"type":"object"}'
#: Kinds whose output is one JSON document (parsed and validated after decoding).
JSON_KINDS: Final = ("json_schema", "json_object")
#: Kinds whose output the JSON-shaping options apply to: the JSON kinds.  A
#: structural tag carries its own per-format options (xgrammar's format objects).
JSON_OPTION_KINDS: Final = JSON_KINDS
#: Options that shape JSON output.
JSON_OPTION_NAMES: Final = ("strict", "whitespace", "indent", "any_order")
#: Decoding policies (every kind), their values, the default first:
#: ``on_budget``: ``close`` forces the shortest valid completion before
#: ``max_tokens`` runs out, ``truncate`` cuts there; ``on_repeat``: ``close``
#: forces the completion of a runaway repetition, ``continue`` lets it run;
#: ``backend``: the grammar engine that serves the constraint, ``auto`` the
#: server's choice (llguidance for JSON, xgrammar for the rest, each falling
#: back to the other; RESULT ``backend`` says which served).
POLICIES: Final[Mapping[str, tuple[str, ...]]] = {
    "on_budget": ("close", "truncate"),
    "on_repeat": ("close", "continue"),
    "backend": ("auto", "xgrammar", "llguidance"),
}
#: The grammar engines behind ``backend`` (RESULT ``backend`` is one of them).
BACKENDS: Final = POLICIES["backend"][1:]
#: Boolean decoding options (every kind) and their defaults: ``jump_forward``
#: appends the text the grammar forces without sampling it, several tokens
#: per forward (``grammar_backend.jump``); the output text is the same.
DECODING_FLAGS: Final[Mapping[str, bool]] = {"jump_forward": True}
#: ``value_retries`` (JSON kinds only, like the JSON options; an integer) default and bound: how many
#: times one output may drop tokens to retry a completed value that breaks
#: the schema where the grammar cannot express it (``grammar_backend.values``);
#: 0 turns the value checks off.  RESULT ``value_retries`` says how many were used.
VALUE_RETRIES: Final = 8
MAX_VALUE_RETRIES: Final = 64
OPTION_NAMES: Final = (*JSON_OPTION_NAMES, *POLICIES, *DECODING_FLAGS, "value_retries")
#: Bound on a whitespace run when the policy is an integer (larger bounds let a
#: model loop on whitespace, which the ``"compact"`` default prevents).
MAX_WHITESPACE_RUN: Final = 64
#: Bound on a whitespace run in the JSON a structural tag embeds (tool-call
#: arguments), where its ``json_schema`` format sets no ``max_whitespace_cnt``
#: of its own: the JSON kinds' ``"compact"`` has no counterpart there, and 1 is
#: the least xgrammar takes (``{"a": [1, 2]}`` passes, a run of newlines does not).
TAG_WHITESPACE_RUN: Final = 1
MAX_INDENT: Final = 16
#: Largest constraint payload, UTF-8 bytes.
MAX_CONSTRAINT_BYTES: Final = 2 * 1024 * 1024
#: A constraint larger than this (payload and options, bytes) is heavy: its checks in preprocessing may take
#: seconds (a 1.9 MB schema's meta-schema check about 4 s) and its compile minutes, so it is checked in
#: preprocessing's heavy lane and its compiles leave a compile thread to small ones (render value
#: ``HEAVY_CONSTRAINT_BYTES``).  A 61 KB schema's checks took 0.17 s; of the 2,890 maskbench-dev schemas (real
#: tool and extraction schemas) the median is 0.7 KB and 31 are larger (the largest 229 KB).
HEAVY_CONSTRAINT_BYTES: Final = 65_536
#: Most draft tokens one row of a grammar step may carry (speculative decoding): a step returns a mask for
#: the position after each.  TensorRT-LLM's linear drafters (MTP, Eagle-3's chain, n-gram) propose a few a
#: step; the engine's draft masks take this many times ``max_batch`` rows at most.
MAX_DRAFT_TOKENS: Final = 16
#: Deepest JSON nesting of a constraint payload (objects and arrays).
MAX_CONSTRAINT_DEPTH: Final = 128
#: Largest gRPC message the public port takes or sends (deploy/gateway.py): one
#: request carries at most one constraint (:data:`MAX_CONSTRAINT_BYTES`) plus a
#: prompt or chat history, options and the protobuf envelope (tensor names,
#: shapes, parameters: well under 1 KiB).  The prompt is bounded in tokens by
#: preprocessing (``max_prompt_tokens``, 4,096 by default: ~16 KiB of English
#: text), so an equal 2 MiB of headroom takes any valid request and a larger
#: message is refused (``RESOURCE_EXHAUSTED``) before it is parsed.
MAX_MESSAGE_BYTES: Final = 2 * MAX_CONSTRAINT_BYTES

MAX_TEMPERATURE: Final = 2.0
#: ``repetition_penalty`` is in ``(0, MAX_REPETITION_PENALTY]`` (1 = off): the logit of every token
#: already in the prompt or the output is divided by it when positive and multiplied by it when
#: negative (HF, vLLM and TensorRT-LLM's rule).  Past 2 a model stops reusing JSON's own punctuation.
MAX_REPETITION_PENALTY: Final = 2.0
#: ``frequency_penalty`` and ``presence_penalty`` are in ``[-MAX_PENALTY, MAX_PENALTY]`` (0 = off,
#: OpenAI's range): ``count * frequency_penalty + (count > 0) * presence_penalty`` is subtracted from
#: the logit of each token by its count in the output so far (the prompt is not counted, as in OpenAI's API).
MAX_PENALTY: Final = 2.0
#: The sampling fields that fight repetition, and the value of each that turns it off.  ``min_p``
#: (in ``[0, 1]``) keeps the tokens whose probability is at least ``min_p`` times the most likely one's.
#: Every one applies after the grammar mask: a masked token stays masked, and an allowed token stays
#: possible (finite logits only move by finite amounts).
PENALTY_FIELDS: Final[Mapping[str, float]] = {
    "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_p": 0.0}
MAX_TOP_K: Final = 2**31 - 1
#: ``MAX_TOKENS`` is INT32: the wire bound, which the SDK checks.  The serving bound is one
#: value, ``MAX_TOKENS_LIMIT`` (deploy/values.json), rendered into preprocessing's ``max_tokens_limit``:
#: preprocessing refuses above it and later stages trust it (the engine checks only its context).
MAX_MAX_TOKENS: Final = 2**31 - 1
#: Seeds are in ``[0, SEED_LIMIT)`` (uint64).
SEED_LIMIT: Final = 2**64
MAX_STOP_STRINGS: Final = 8
MAX_STOP_CHARS: Final = 256
#: ``n`` of the OpenAI-compatible endpoint: choices per request, each one independent sequence with its
#: own grammar row (and its own stream slot against an API key's ``max_streams``).  OpenAI allows 128;
#: 16 keeps one request from filling the in-flight batch (``max_batch_size`` 16-64) by itself.
MAX_CHOICES: Final = 16
#: ``top_logprobs`` (alternatives reported per output token) is in ``[0, MAX_TOP_LOGPROBS]``, OpenAI's bound.
MAX_TOP_LOGPROBS: Final = 20

#: A chat message on the wire (MESSAGES): ``role`` (one of :data:`MESSAGE_ROLES`) and ``content``, both
#: strings, and optionally ``name``, the speaker's name (OpenAI's message ``name``), which preprocessing
#: hands to the chat template with the message: a template that renders names shows it to the model.
MESSAGE_ROLES: Final = ("system", "user", "assistant")
MESSAGE_KEYS: Final = ("role", "content", "name")

FINISH_REASONS: Final = ("stop", "length", "error")
#: Why the grammar side forced a completion (RESULT ``close_reason``).
CLOSE_REASONS: Final = ("budget", "repetition")


class ContractError(ValueError):
    """A request field breaks the contract.

    Parameters
    ----------
    field : str
        The field, e.g. ``"grammar_options.indent"`` or ``"top_p"``.
    reason : str
        Why; the message is ``"field: reason"``.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def check_options(kind: str, options: Mapping[str, object]) -> dict[str, object]:
    """Check a constraint's options; return them with every default filled in.

    Parameters
    ----------
    kind : str
        One of :data:`CONSTRAINT_KINDS` (checked by the caller).
    options : mapping
        The options the request gives (absent = default).

    Returns
    -------
    dict
        ``strict``, ``whitespace``, ``indent``, ``any_order``, ``on_budget``,
        ``on_repeat``, ``backend``, ``jump_forward``, ``value_retries``.

    Raises
    ------
    ContractError
        An unknown option, a JSON option set (to other than its default) on
        a kind it does not apply to, or a value of the wrong type or range.
    """
    if not isinstance(options, Mapping):
        raise ContractError("grammar_options", f"must be an object, got {type(options).__name__}")
    for name in options:
        if name not in OPTION_NAMES:
            raise ContractError(f"grammar_options.{name}", f"unknown option; expected one of {', '.join(OPTION_NAMES)}")
    out: dict[str, object] = {}
    for name, allowed in POLICIES.items():
        value = options.get(name, allowed[0])
        if not isinstance(value, str) or value not in allowed:
            raise ContractError(f"grammar_options.{name}", f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        out[name] = value
    for name, off in (("strict", False), ("any_order", False), *DECODING_FLAGS.items()):
        value = options.get(name, off)
        if not isinstance(value, bool):
            raise ContractError(f"grammar_options.{name}", f"must be a boolean, got {value!r}")
        out[name] = value
    whitespace = options.get("whitespace", "compact")
    if isinstance(whitespace, bool) or not (
        whitespace in ("compact", "any") or (isinstance(whitespace, int) and 0 <= whitespace <= MAX_WHITESPACE_RUN)
    ):
        raise ContractError("grammar_options.whitespace",
                            f'must be "compact", "any" or an integer 0..{MAX_WHITESPACE_RUN}, got {whitespace!r}')
    out["whitespace"] = whitespace
    indent = options.get("indent")
    if indent is not None and (isinstance(indent, bool) or not isinstance(indent, int) or not 0 <= indent <= MAX_INDENT):
        raise ContractError("grammar_options.indent", f"must be null or an integer 0..{MAX_INDENT}, got {indent!r}")
    out["indent"] = indent
    retries = options.get("value_retries", VALUE_RETRIES)
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_VALUE_RETRIES:
        raise ContractError("grammar_options.value_retries",
                            f"must be an integer 0..{MAX_VALUE_RETRIES}, got {retries!r}")
    out["value_retries"] = retries
    if kind not in JSON_OPTION_KINDS:
        for name, default in _JSON_OPTION_DEFAULTS.items():
            if out[name] != default:
                raise ContractError(f"grammar_options.{name}",
                                    f"only applies to {' and '.join(JSON_OPTION_KINDS)}, not {kind}")
    return out


_JSON_OPTION_DEFAULTS: Final[Mapping[str, object]] = {"strict": False, "whitespace": "compact", "indent": None,
                                                      "any_order": False, "value_retries": VALUE_RETRIES}


def check_sampling(
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: Sequence[str],
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    min_p: float = 0.0,
) -> None:
    """Check the sampling fields (``max_tokens`` is bounded by the server's configuration, not here).

    Raises
    ------
    ContractError
        Naming the first field out of range: ``temperature`` in
        ``[0, MAX_TEMPERATURE]``, ``top_p`` in ``(0, 1]``, ``top_k`` in
        ``[0, MAX_TOP_K]`` (0 = off), ``seed`` in ``[0, SEED_LIMIT)``, at most
        :data:`MAX_STOP_STRINGS` non-empty stop strings of at most
        :data:`MAX_STOP_CHARS` characters, ``repetition_penalty`` in
        ``(0, MAX_REPETITION_PENALTY]``, ``frequency_penalty`` and
        ``presence_penalty`` in ``[-MAX_PENALTY, MAX_PENALTY]``, ``min_p`` in
        ``[0, 1]`` (see :data:`PENALTY_FIELDS`).
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE
    ):
        raise ContractError("temperature", f"must be a number in 0..{MAX_TEMPERATURE:g}, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise ContractError("top_p", f"must be a number in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise ContractError("top_k", f"must be an integer in 0..{MAX_TOP_K} (0 = off), got {top_k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT):
        raise ContractError("seed", f"must be an integer in [0, 2**64), got {seed!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ContractError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise ContractError(f"stop[{i}]", "must be a non-empty string")
        if len(s) > MAX_STOP_CHARS:
            raise ContractError(f"stop[{i}]", f"is {len(s)} characters; at most {MAX_STOP_CHARS}")
    if not _number_in(repetition_penalty, 0.0, MAX_REPETITION_PENALTY) or repetition_penalty == 0:
        raise ContractError("repetition_penalty",
                            f"must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got {repetition_penalty!r}")
    for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
        if not _number_in(value, -MAX_PENALTY, MAX_PENALTY):
            raise ContractError(name, f"must be a number in -{MAX_PENALTY:g}..{MAX_PENALTY:g} (0 = off), got {value!r}")
    if not _number_in(min_p, 0.0, 1.0):
        raise ContractError("min_p", f"must be a number in 0..1 (0 = off), got {min_p!r}")


def check_logprobs(logprobs: object) -> int | None:
    """Check ``logprobs``: ``None`` (off) or how many alternatives to report per output token.

    What is reported, for every token of the output (the end token that
    ends it excepted, as its text is not part of the output): the token's
    log probability and its ``logprobs`` most likely alternatives, most
    likely first.  They are read from the distribution the grammar allows,
    after the grammar mask and the penalties (:data:`PENALTY_FIELDS`) and
    before temperature, ``top_k``, ``top_p`` and ``min_p`` narrow it: the
    log-softmax of the masked logits.  So a token the grammar forbids is
    never an alternative (fewer than ``logprobs`` are listed where the
    grammar allows fewer tokens), and a token the grammar forces (the only
    one it allows) has log probability 0.  Tokens the server appends without
    sampling (jump-forward) are reported the same way: log probability 0,
    themselves their only alternative.

    Parameters
    ----------
    logprobs : object
        The request's value.

    Returns
    -------
    int or None
        The value, checked.

    Raises
    ------
    ContractError
        Naming ``logprobs``: not ``None`` nor an integer in ``[0, MAX_TOP_LOGPROBS]``.
    """
    if logprobs is None:
        return None
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ContractError("logprobs", f"must be null (off) or an integer in 0..{MAX_TOP_LOGPROBS} (alternatives "
                                        f"per token), got {logprobs!r}")
    return logprobs


#: The sampling fields whose logits at a position depend on the tokens before it: a request with one of
#: them on cannot ask for draft tokens (:func:`check_draft_tokens`).
DRAFT_EXCLUDED_PENALTIES: Final = ("repetition_penalty", "frequency_penalty", "presence_penalty")


def check_draft_tokens(draft_tokens: object, *, penalties: Mapping[str, object] | None = None,
                       logprobs: object = None) -> int | None:
    """Check ``draft_tokens``: ``None`` (the server's default) or the most draft tokens a step may feed.

    Prompt-lookup speculation (``llm_runtime.speculation``): each step feeds,
    after the request's last token, up to this many tokens copied from
    earlier in its prompt and output, and keeps those the model would have
    sampled (0: off).  The grammar masks every draft position, so a draft
    it forbids is never kept, and greedy outputs are those without
    speculation.  A penalty changes the logits at each position by the
    tokens before it, and log probabilities are reported per sampled
    position: a request with either cannot ask for drafts.

    Parameters
    ----------
    draft_tokens : object
        The request's value.
    penalties : mapping, optional
        The request's :data:`PENALTY_FIELDS` (checked already; absent or None:
        off).
    logprobs : object
        The request's ``logprobs`` (None: off).

    Returns
    -------
    int or None
        The value, checked.

    Raises
    ------
    ContractError
        Naming ``draft_tokens``: not ``None`` nor an integer in
        ``[0, MAX_DRAFT_TOKENS]``, or positive with a penalty or ``logprobs``.
    """
    if draft_tokens is None:
        return None
    if (isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int)
            or not 0 <= draft_tokens <= MAX_DRAFT_TOKENS):
        raise ContractError("draft_tokens", f"must be null (the server's default) or an integer in "
                                            f"0..{MAX_DRAFT_TOKENS}, got {draft_tokens!r}")
    if draft_tokens:
        given = penalties or {}
        if any(given.get(name) not in (None, PENALTY_FIELDS[name]) for name in DRAFT_EXCLUDED_PENALTIES):
            raise ContractError("draft_tokens", "prompt-lookup speculation cannot be combined with a repetition, "
                                                "frequency or presence penalty")
        if logprobs is not None:
            raise ContractError("draft_tokens", "prompt-lookup speculation cannot be combined with logprobs")
    return draft_tokens


def _number_in(value: object, lo: float, hi: float) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and lo <= value <= hi)
