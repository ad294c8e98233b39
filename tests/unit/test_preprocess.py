"""Request validation of the preprocessing model, and the REQUEST round trip."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

import contract
from grammar_backend.errors import ConfigError, ConstraintError, InvalidArgument
from pipeline.checker import Checker
from pipeline.preprocess import (
    GenerationParams,
    PreprocessConfig,
    Preprocessor,
    RawRequest,
    RejectedRequest,
    rejection_json,
)
from tests.support import assets

CONFIG = PreprocessConfig(tokenizer=str(assets.SMOLLM2_DIR), max_prompt_tokens=64, max_tokens_limit=100,
                          default_max_tokens=50)


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    assets.smollm2_dir()  # CONFIG names it: skip, or fail under REQUIRE_ASSETS=1, where it is missing
    return Preprocessor.from_config(CONFIG)


@pytest.mark.parametrize(
    ("raw", "error", "match"),
    [
        (RawRequest(), InvalidArgument, r"^prompt: exactly one of PROMPT and MESSAGES is required$"),
        (RawRequest(prompt=b"a", messages=b"[]"), InvalidArgument, r"^prompt: exactly one of PROMPT and MESSAGES"),
        (RawRequest(prompt=b"\xc3("), InvalidArgument, r"^prompt: not valid UTF-8 at byte 0$"),
        (RawRequest(prompt=b"  "), InvalidArgument, r"^prompt: is empty$"),
        (RawRequest(messages=b'[{"role": "bot", "content": "x"}]'), InvalidArgument,
         r"^messages\[0\].role: must be one of system, user, assistant, got 'bot'$"),
        (RawRequest(messages=b"[1]"), InvalidArgument,
         r"^messages\[0\]: must be an object with role and content \(and optionally name\)$"),
        (RawRequest(messages=b'[{"role": "user", "content": "x", "tool_calls": []}]'), InvalidArgument,
         r"^messages\[0\]: must be an object with role and content \(and optionally name\)$"),
        (RawRequest(messages=b'[{"role": "user", "content": "x", "name": 7}]'), InvalidArgument,
         r"^messages\[0\].name: must be a string$"),
        (RawRequest(messages=b"[{"), InvalidArgument, r"^messages: invalid JSON at line 1 column 3"),
        (RawRequest(prompt=b"x", max_tokens=0), InvalidArgument, r"^max_tokens: must be in 1..100, got 0$"),
        (RawRequest(prompt=b"x", max_tokens=101), InvalidArgument, r"^max_tokens: must be in 1..100, got 101$"),
        (RawRequest(prompt=b"x", temperature=float("nan")), InvalidArgument, r"^temperature: must be a number in 0..2, got nan$"),
        (RawRequest(prompt=b"x", top_p=0.0), InvalidArgument, r"^top_p: must be a number in \(0, 1\], got 0.0$"),
        (RawRequest(prompt=b"x", top_k=-1), InvalidArgument, r"^top_k: must be an integer in 0..2147483647 \(0 = off\), got -1$"),
        (RawRequest(prompt=b"x", stop=(b"",)), InvalidArgument, r"^stop\[0\]: must be a non-empty string$"),
        (RawRequest(prompt=b"x", stop=(b"a",) * 9), InvalidArgument, r"^stop: at most 8 stop strings, got 9$"),
        (RawRequest(prompt=b"x", grammar=b"{}"), InvalidArgument,
         r"^grammar_type: is required when GRAMMAR or GRAMMAR_OPTIONS is given$"),
        (RawRequest(prompt=b"x", grammar_type=b"json_schema", grammar=b'{"type": 1}'), ConstraintError,
         r"^grammar#/type: not a valid JSON Schema"),
        (RawRequest(prompt=b"x" * 300), InvalidArgument,
         r"^prompt: is \d+ tokens after the chat template; the limit is 64$"),
        (RawRequest(messages=b'[{"role":"user","content":"a\\ud800"}]'), InvalidArgument,
         r"^messages\[0\]\.content: contains an unpaired surrogate \(\\ud800\) at character 1$"),
        (RawRequest(messages=b"[" * 10_000 + b"]" * 10_000), InvalidArgument,
         r"^messages: nested too deeply \(expected an array of \{role, content\}\)$"),
        (RawRequest(prompt=b"x", grammar_type=b"json_schema", grammar=b'{"const":"\\udc00"}'), ConstraintError,
         r"^grammar: contains an unpaired surrogate escape \(\\udc00\)$"),
        (RawRequest(prompt=b"x", grammar_type=b"json_schema",
                    grammar=b'{"properties":{"a":{"$ref":"https://example.com/s.json"}}}'), ConstraintError,
         r"^grammar#/properties/a/\$ref: cannot resolve 'https://example.com/s.json' \(remote references"),
    ],
)
def test_bad_requests_name_field_and_reason(pre: Preprocessor, raw: RawRequest, error: type[Exception],
                                            match: str) -> None:
    with pytest.raises(error, match=match):
        pre(raw)


def test_prompt_gets_the_chat_template(pre: Preprocessor) -> None:
    ids, params = pre(RawRequest(prompt=b"Hi"))
    text = pre.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # Every default but the seed, which is drawn for an unseeded request (test_unseeded_requests_draw_fresh_seeds).
    assert dataclasses.replace(params, seed=0) == GenerationParams(max_tokens=CONFIG.default_max_tokens)


def test_every_kind_carries_its_decoding_policies(pre: Preprocessor) -> None:
    raw = RawRequest(prompt=b"hi", grammar_type=b"regex", grammar=b"[a-z]+", grammar_options=b'{"on_budget": "truncate"}')
    _, params = pre(raw)
    assert params.constraint is not None
    assert json.loads(params.constraint["options"])["on_budget"] == "truncate"


def test_request_round_trip(pre: Preprocessor) -> None:
    raw = RawRequest(
        messages=json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Zoë?"}]).encode(),
        grammar_type=b"json_schema", grammar=b'{ "type": "object" }', grammar_options=b'{"strict": true}',
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop=(b"\n\n",),
        repetition_penalty=1.25, presence_penalty=-0.5, min_p=0.1,
    )
    _, params = pre(raw)
    assert (params.repetition_penalty, params.frequency_penalty, params.presence_penalty, params.min_p) == (
        1.25, 0.0, -0.5, 0.1)
    expected: dict[str, Any] = {"kind": "json_schema", "payload": '{"type":"object"}',
                                "options": '{"strict":true,"whitespace":"compact","indent":null,"any_order":false,'
                                           '"on_budget":"close","on_repeat":"close","backend":"auto","jump_forward":true,'
                                               '"value_retries":8}'}
    assert params.constraint == expected
    assert GenerationParams.from_json(params.to_json()) == params
    assert (params.max_tokens, params.temperature, params.top_k, params.seed, params.stop) == (7, 0.5, 40, 3, ("\n\n",))


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (InvalidArgument("max_tokens", "must be in 1..100, got 0"), "INVALID_ARGUMENT"),
        (KeyError("bug"), "INTERNAL"),
    ],
)
def test_a_refusal_travels_as_data_with_its_status(err: Exception, status: str) -> None:
    """Preprocessing never sends an error response: llm reads the refusal back with its status."""
    with pytest.raises(RejectedRequest) as info:
        GenerationParams.from_json(rejection_json(err))
    assert (info.value.status, str(info.value)) == (status, str(err))


def test_a_refused_constraint_is_refused_again_without_a_parse(pre: Preprocessor,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.preprocess as pp
    from grammar_backend.spec import parse_constraint as real

    parses: list[str] = []

    def counted(kind: str, payload: Any, options: Any = None, limits: Any = None) -> Any:
        parses.append(kind)
        return real(kind, payload, options, limits)

    monkeypatch.setattr(pp, "parse_constraint", counted)
    bad = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "wat"} for i in range(3000)}}).encode()
    raw = RawRequest(prompt=b"hi", grammar_type=b"json_schema", grammar=bad)
    messages = []
    for _ in range(3):
        with pytest.raises(InvalidArgument) as info:
            pre(raw)
        messages.append((info.value.status, str(info.value)))
    assert parses == ["json_schema"] and len(set(messages)) == 1  # the same answer, one parse
    assert messages[0][0] == "INVALID_ARGUMENT" and messages[0][1].startswith("grammar")
    pre(RawRequest(prompt=b"hi", grammar_type=b"regex", grammar=b"[ab]+"))  # a good one still parses
    pre(RawRequest(prompt=b"hi", grammar_type=b"regex", grammar=b"[ab]+"))  # and is never cached as refused
    assert parses == ["json_schema", "regex", "regex"]


# --------------------------------------------------------------------------- checkpoints without a chat template
@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose tokenizer has no chat template (as a base model's)."""
    from standins.tiny_model import build_tiny_llama

    info = build_tiny_llama(tmp_path_factory.mktemp("base") / "model")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(info.path), local_files_only=True).chat_template is None
    return info.path


def test_a_tokenizer_without_a_chat_template_is_refused_at_load_with_what_to_add(base_model: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no chat template\. Add one \(a chat_template\.jinja file, or "
                                          r"chat_template in tokenizer_config\.json\), or serve it as a base model "
                                          r"with PROMPT_FORMAT=plain"):
        Preprocessor.from_config(PreprocessConfig(tokenizer=str(base_model)))


def test_plain_prompt_format_passes_the_prompt_through(base_model: Path) -> None:
    from transformers import AutoTokenizer

    pre = Preprocessor.from_config(PreprocessConfig(tokenizer=str(base_model), prompt_format="plain",
                                                    max_prompt_tokens=64))
    tok = AutoTokenizer.from_pretrained(str(base_model), local_files_only=True)
    ids, params = pre(RawRequest(prompt=b"The capital of France is", max_tokens=5))
    assert ids == tok("The capital of France is", add_special_tokens=True)["input_ids"] and params.max_tokens == 5
    with pytest.raises(InvalidArgument, match=r"^messages: this model has no chat template \(prompt format plain\): "
                                              r"send PROMPT, which is passed through as text$"):
        pre(RawRequest(messages=b'[{"role": "user", "content": "hi"}]'))
    with pytest.raises(InvalidArgument, match=r"^prompt: is \d+ tokens as plain text; the limit is 64$"):
        pre(RawRequest(prompt=b"word " * 100))


def test_prompt_format_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"^preprocessing: prompt_format must be one of chat, plain, got 'raw'$"):
        PreprocessConfig(tokenizer="unused", prompt_format="raw")


def test_unseeded_requests_draw_fresh_seeds(pre: Preprocessor) -> None:
    # A fixed default made every unseeded request at temperature 1 the same; the seed drawn travels in REQUEST.
    seeds = [pre(RawRequest(prompt=b"hi", temperature=1.0))[1].seed for _ in range(2)]
    assert seeds[0] != seeds[1]
    assert all(0 <= seed < contract.SEED_LIMIT for seed in seeds)


@pytest.mark.parametrize("seed", [0, 7, 2**64 - 1])
def test_a_seeded_request_keeps_its_seed(pre: Preprocessor, seed: int) -> None:
    _, params = pre(RawRequest(prompt=b"hi", temperature=1.0, seed=seed))
    assert params.seed == seed
    assert GenerationParams.from_json(params.to_json()).seed == seed


@pytest.mark.parametrize("logprobs", [None, 0, 3, 20])
def test_logprobs_travel_in_request(pre: Preprocessor, logprobs: int | None) -> None:
    _, params = pre(RawRequest(prompt=b"hi", logprobs=logprobs))
    assert params.logprobs == logprobs
    assert ("logprobs" in json.loads(params.to_json())) == (logprobs is not None)  # absent: REQUEST as before
    assert GenerationParams.from_json(params.to_json()) == params


@pytest.mark.parametrize("logprobs", [-1, 21, 2**31 - 1])
def test_logprobs_out_of_range_are_refused_by_name(pre: Preprocessor, logprobs: int) -> None:
    with pytest.raises(InvalidArgument, match=rf"^logprobs: must be null \(off\) or an integer in 0\.\.20 "
                                              rf"\(alternatives per token\), got {logprobs}$"):
        pre(RawRequest(prompt=b"hi", logprobs=logprobs))


@pytest.mark.parametrize("drafts", [None, 0, 4, 16])
def test_draft_tokens_travel_in_request(pre: Preprocessor, drafts: int | None) -> None:
    _, params = pre(RawRequest(prompt=b"hi", draft_tokens=drafts))
    assert params.draft_tokens == drafts
    assert ("draft_tokens" in json.loads(params.to_json())) == (drafts is not None)  # absent: the llm's default
    assert GenerationParams.from_json(params.to_json()) == params


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"draft_tokens": 17}, r"^draft_tokens: must be null \(the server's default\) or an integer in 0\.\.16, got 17$"),
        ({"draft_tokens": -1}, r"^draft_tokens: must be null .* got -1$"),
        ({"draft_tokens": 3, "presence_penalty": 0.5},
         (r"^draft_tokens: prompt-lookup speculation cannot be combined with a repetition, frequency or presence "
          r"penalty$")),
        ({"draft_tokens": 3, "logprobs": 0}, r"^draft_tokens: prompt-lookup speculation cannot be combined with logprobs$"),
    ],
    ids=["too-many", "negative", "penalty", "logprobs"],
)
def test_bad_draft_tokens_are_refused_by_name(pre: Preprocessor, fields: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        pre(RawRequest(prompt=b"hi", **fields))


HEAVY = dataclasses.replace(CONFIG, heavy_constraint_bytes=100)


def _schema_request(tag: str, *, bad: bool = False, size: int = 200) -> RawRequest:
    """A schema request of about ``size`` bytes, new to this process (``tag``)."""
    schema: dict[str, Any] = {"description": f"{tag} " + "x" * size, "type": "integer" if not bad else 1}
    return RawRequest(prompt=b"x", seed=7, grammar_type=b"json_schema", grammar=json.dumps(schema).encode())


@pytest.mark.parametrize(
    ("raw", "heavy"),
    [
        (RawRequest(prompt=b"x"), False),  # no constraint
        (_schema_request("small", size=10), False),  # within heavy_constraint_bytes
        (_schema_request("large"), True),  # larger, never seen
        (_schema_request("large and bad", bad=True), True),  # a refusal is the lane's to find
    ],
)
def test_only_a_large_constraint_new_to_the_process_goes_to_the_heavy_lane(pre: Preprocessor, raw: RawRequest,
                                                                          heavy: bool) -> None:
    lanes = Preprocessor(HEAVY, pre.tokenizer)
    assert lanes.heavy(lanes.prepare(raw)) is heavy


@pytest.mark.parametrize("bad", [False, True])
def test_a_large_constraint_checked_once_stays_on_the_stubs_thread(pre: Preprocessor, bad: bool) -> None:
    """Seen before (either verdict, from the heavy lane's child): it does not queue behind new large ones,
    and it completes from the verdict, exactly as the first time."""
    lanes = Preprocessor(HEAVY, pre.tokenizer)
    raw = _schema_request(f"seen {bad}", bad=bad)
    pending = lanes.prepare(raw)
    assert lanes.heavy(pending)
    checker = Checker(cpu_s=30.0)
    try:
        if bad:
            with pytest.raises(ConstraintError, match=r"^grammar#/type: not a valid JSON Schema"):
                lanes.complete(pending, checker.check)
        else:
            first = lanes.complete(pending, checker.check)
    finally:
        checker.close()
    again = lanes.prepare(raw)
    assert not lanes.heavy(again)
    if bad:
        with pytest.raises(ConstraintError, match=r"^grammar#/type: not a valid JSON Schema"):
            lanes.complete(again)
    else:
        assert lanes.complete(again) == first


def test_only_a_heavy_constraint_is_handed_to_the_check(pre: Preprocessor) -> None:
    """The heavy lane's check (a child process) is for large new constraints; a small one is checked here."""
    lanes = Preprocessor(HEAVY, pre.tokenizer)
    handed: list[bytes] = []
    small = lanes.prepare(_schema_request("handed small", size=10))
    assert lanes.complete(small, lambda c: handed.append(c.payload))[1].constraint is not None
    assert handed == []
    large = lanes.prepare(_schema_request("handed large"))
    assert large.constraint is not None
    # The stand-in check records no verdict, so the constraint is then checked here.
    assert lanes.complete(large, lambda c: handed.append(c.payload))[1].constraint is not None
    assert handed == [large.constraint.payload]


def test_prepare_then_complete_is_the_whole_check(pre: Preprocessor) -> None:
    raw = _schema_request("whole")
    pending = pre.prepare(raw)
    assert pending.params.constraint is None  # not checked yet
    ids, params = pre.complete(pending)
    assert (ids, params) == pre(raw)
    assert params.constraint is not None and params.constraint["kind"] == "json_schema"


@pytest.mark.parametrize(("field", "value"), [("heavy_constraint_bytes", -1), ("heavy_queue", 0), ("heavy_cpu_s", 0.0)])
def test_heavy_lane_settings_out_of_range_are_refused(field: str, value: float) -> None:
    settings: dict[str, Any] = {field: value}
    with pytest.raises(ConfigError, match=r"^preprocessing: need heavy_constraint_bytes >= 0, heavy_queue >= 1 and "
                                          r"heavy_cpu_s > 0, got "):
        dataclasses.replace(CONFIG, **settings)
