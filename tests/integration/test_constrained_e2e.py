"""End to end over real gRPC: client -> tritonserver (ensemble constrained_llm) -> streamed, valid output.

One server (the real bundled tritonserver behind the gateway on free loopback
ports, the real SmolLM2-135M model on CPU, real xgrammar) serves every test of
this module (fixtures in tests/integration/conftest.py).
"""

from __future__ import annotations

import io
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from client import Client, Constraint
from client.__main__ import EXIT_CLOSED, EXIT_TRUNCATED
from client.__main__ import main as client_main
from client.errors import ClosedEarly, InvalidConstraint, TruncatedOutput
from client.sdk import Chunk
from deploy.server import TritonServer
from tests.integration.served import (
    NEVER_ENDS,
    OUTPUTS,
    assert_cancelled,
    counter_sum,
    grammar_active,
    grammar_call,
    metric,
    sequences_freed,
    wait_active_zero,
    wait_freed,
)
from tests.support.poll import HANG_S, poll, wait_for

SCHEMAS = Path(__file__).resolve().parents[1] / "fixtures" / "schemas"

pytestmark = [pytest.mark.triton, pytest.mark.e2e]


def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / f"{name}.json").read_text())  # type: ignore[no-any-return]


PROMPTS = ["Invent a person.", "Describe a customer order.", "Make a small tree of numbers.", "What is the weather?"]


@pytest.mark.parametrize("name", ["person", "order", "tree", "tool_weather", "open_object"])
def test_every_completed_json_output_parses_and_validates(client: Client, name: str) -> None:
    """The guarantee: a completed output always parses and validates. A 135M model often loops
    inside a string until max_tokens: budget closing (the default) then ends it with the shortest
    valid completion, reported as `closed_early` (valid, not `complete`); a close that cannot fit
    is `length`, never a success; of the two prompts, at least one ends valid (not only truncated)."""
    schema = _schema(name)
    valid = 0
    for prompt in PROMPTS[:2]:
        prompt = f"{prompt} Reply with JSON matching this schema: {json.dumps(schema)}"
        result = client.generate(prompt, constraint=Constraint.json_schema(schema), max_tokens=96,
                                 require_complete=False)
        assert result.usage.completion_tokens <= 96
        if result.closed_early:
            assert not result.complete
            assert (result.finish_reason, result.close_reason) in (("length", "budget"), ("stop", "repetition"))
        elif not result.complete:
            # Cut at the budget (a close that cannot fit): never reported as parsed, never a success.
            assert (result.finish_reason, result.close_reason, result.usage.completion_tokens) == ("length", None, 96)
            assert result.json is not None and not result.json.parsed, result
            continue
        else:
            assert (result.finish_reason, result.close_reason) == ("stop", None)
        valid += 1
        parsed = json.loads(result.text)
        assert result.parsed == parsed
        jsonschema.Draft202012Validator(schema).validate(parsed)
        assert result.json is not None and result.json.parsed and result.json.valid
    assert valid >= 1, f"{name}: every output was truncated"


@pytest.mark.parametrize(
    ("constraint", "pattern"),
    [
        (Constraint.regex(r"[0-9]{3}-[a-z]{2,6}"), r"[0-9]{3}-[a-z]{2,6}"),
        (Constraint.choice(["red", "green", "blue"]), r"red|green|blue"),
        (Constraint.ebnf('root ::= "The answer is " [0-9]+ "."'), r"The answer is [0-9]+\."),
    ],
)
def test_text_constraints_match(client: Client, constraint: Constraint, pattern: str) -> None:
    result = client.generate("Answer briefly.", constraint=constraint, max_tokens=40)
    assert result.finish_reason == "stop" and result.complete
    assert re.fullmatch(pattern, result.text), result.text
    assert result.backend == "xgrammar"  # backend: auto, and xgrammar compiles all of these


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize(
    ("constraint", "pattern"),
    [
        (Constraint.regex(r"\{[0-9]+\n\}"), r"\{[0-9]+\n\}"),
        (Constraint.regex(r"\{[0-9]+\tX"), r"\{[0-9]+\tX"),
        (Constraint.ebnf('root ::= "{" [0-9]+ "\\n}"'), r"\{[0-9]+\n\}"),
    ],
)
def test_a_runaway_number_before_a_forced_control_character_is_closed(client: Client, constraint: Constraint,
                                                                       pattern: str, backend: str) -> None:
    """The model writes digits without end (greedy ``1111...``); the ending the grammar forces holds a ``\\n`` or
    a ``\\t``, which the completion search once never tried: the output ran to ``max_tokens`` broken.  Now it
    ends complete under its constraint, by the model or closed (repetition, else the budget)."""
    result = client.generate("Write one very long number in braces.", constraint=constraint.with_policies(
        backend=backend), max_tokens=64, require_complete=False)
    assert re.fullmatch(pattern, result.text), result
    assert result.complete or result.close_reason in ("repetition", "budget"), result
    assert result.usage.completion_tokens <= 64


@pytest.mark.parametrize(
    ("constraint", "backend", "pattern"),
    [
        # Forced: llguidance serves a schema xgrammar would serve too.
        (Constraint.json_schema(_schema("tool_weather")).with_policies(backend="llguidance"), "llguidance", None),
        (Constraint.regex(r"[0-9]{3}-[a-z]{2,6}").with_policies(backend="llguidance"), "llguidance",
         r"[0-9]{3}-[a-z]{2,6}"),
        # auto: xgrammar 0.2.9 cannot compile \p{L} ("Unicode character class escape sequence is not supported").
        (Constraint.regex(r"\p{L}{2,12}"), "llguidance", r"[^\W\d_]{2,12}"),
    ],
)
def test_the_llguidance_backend_serves_end_to_end(client: Client, constraint: Constraint, backend: str,
                                                  pattern: str | None) -> None:
    result = client.generate("Name a city.", constraint=constraint, max_tokens=48, require_complete=False)
    assert result.backend == backend
    # Ended on its own or closed (at the budget: "length"; on repetition: "stop"): valid either way.
    assert result.complete or (result.closed_early and result.close_reason in ("budget", "repetition")), result
    assert result.finish_reason == ("length" if result.close_reason == "budget" else "stop"), result
    if pattern is None:
        assert result.json is not None and result.json.valid
    else:
        assert re.fullmatch(pattern, result.text), result.text


#: Four distinct letters: what the prompt asks for repeats one.
LETTERS_ONCE = {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "minItems": 4, "maxItems": 4,
                "uniqueItems": True}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_value_checks_retry_a_repeated_item_over_grpc(client: Client, backend: str) -> None:
    """uniqueItems is in neither grammar: the served loop drops the repeated item and generates it again
    (DROPPED over BLS), streams nothing it may drop (HOLD), and RESULT counts the retries; with
    value_retries 0 the same request repeats an item and post-validation flags it."""
    prompt = 'Write the JSON array ["a","a","a","a"].'
    checked = Constraint.json_schema(LETTERS_ONCE).with_policies(backend=backend)
    chunks = list(client.stream(prompt, constraint=checked, max_tokens=40, require_complete=False))
    result = chunks[-1].result
    assert result is not None and result.backend == backend
    assert "".join(c.text for c in chunks) == result.text
    assert result.complete and result.json is not None and result.json.valid, result
    assert sorted(json.loads(result.text)) == ["a", "b", "c", "d"] and result.value_retries > 0
    unchecked = client.generate(prompt, constraint=checked.with_policies(value_retries=0), max_tokens=40,
                                require_complete=False)
    assert unchecked.value_retries == 0 and unchecked.json is not None and not unchecked.json.valid, unchecked
    assert unchecked.json.violations[0].message.endswith("has non-unique elements")


def test_penalties_reach_the_sampler_and_keep_outputs_valid(client: Client) -> None:
    """Greedy output is reproducible, and penalties change it (the tensors reach the sampler); with a schema
    the penalized output still validates."""
    prompt = "Write the word hello thirty times, separated by spaces."
    plain = [client.generate(prompt, max_tokens=40, require_complete=False).text for _ in range(2)]
    penalized = client.generate(prompt, max_tokens=40, frequency_penalty=2.0, repetition_penalty=1.3,
                                require_complete=False)
    assert plain[0] == plain[1] != penalized.text, (plain, penalized.text)
    checked = client.generate("Describe a person as JSON.", constraint=Constraint.json_schema(LETTERS_ONCE),
                              max_tokens=40, presence_penalty=1.5, min_p=0.1, temperature=0.7, seed=3)
    assert checked.complete and checked.json is not None and checked.json.valid, checked


@pytest.mark.parametrize("at_least_one", [False, True])
def test_structural_tag_tool_call(client: Client, at_least_one: bool) -> None:
    tool = _schema("tool_weather")
    if at_least_one:  # xgrammar's own format: the output must contain a tool call
        constraint = Constraint.structural_tag_raw({"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True, "stop_after_first": True,
            "tags": [{"type": "tag", "begin": "<tool_call>", "end": "</tool_call>",
                      "content": {"type": "json_schema", "json_schema": tool}}]}})
    else:  # the short form: free text, tool calls optional
        constraint = Constraint.structural_tag(
            ["<tool_call>"], [{"begin": "<tool_call>", "schema": tool, "end": "</tool_call>"}])
    result = client.generate("Call the weather tool for Paris.", constraint=constraint, max_tokens=120,
                             require_complete=False)
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", result.text, flags=re.DOTALL)
    if at_least_one:
        assert result.complete and len(calls) == 1, result.text
    elif not calls:
        # No call (the empty output included): free text the model ended itself, or cut at the budget;
        # never a half-open call (budget closing closes a started one, and that counts as a call).
        assert "<tool_call>" not in result.text, result.text
        assert (result.finish_reason, result.complete, result.closed_early) in (
            ("stop", True, False), ("length", False, False)), result
    for call in calls:
        jsonschema.Draft202012Validator(tool).validate(json.loads(call))


def test_streaming_deltas_concatenate_to_the_result(client: Client) -> None:
    chunks = list(client.stream("Count to five.", constraint=Constraint.regex("[a-z ,]{5,40}"), max_tokens=30,
                                require_complete=False))
    final = chunks[-1].result
    assert final is not None
    assert "".join(c.text for c in chunks) == final.text
    assert sum(1 for c in chunks if c.text) >= 2  # streamed, not one blob


@pytest.mark.parametrize(("max_tokens", "on_budget"), [(3, "close"), (6, "truncate")])
def test_max_tokens_truncation_is_length_not_success(client: Client, max_tokens: int, on_budget: str) -> None:
    """Truncated: on_budget "truncate", or a budget too small for any completion (3 tokens; 6 cannot fit one either)."""
    constraint = Constraint.json_schema(_schema("person")).with_policies(on_budget=on_budget, on_repeat="continue")
    prompt = "Invent a person with a very long name."
    with pytest.raises(TruncatedOutput) as info:
        client.generate(prompt, constraint=constraint, max_tokens=max_tokens, temperature=1.0, seed=7)
    result = info.value.result
    assert (result.finish_reason, result.complete, result.closed_early) == ("length", False, False)
    assert result.usage.completion_tokens == max_tokens
    assert result.json is not None and not result.json.parsed


@pytest.mark.parametrize("max_tokens", [16, 24])
def test_budget_closing_keeps_a_short_budget_valid(client: Client, max_tokens: int) -> None:
    """At temperature 1 the model rarely finishes a person in 16-24 tokens; every output is still valid."""
    schema = _schema("person")
    closed = 0
    for seed in range(3):
        result = client.generate("Invent a person with a very long name.", constraint=Constraint.json_schema(schema),
                                 max_tokens=max_tokens, temperature=1.0, seed=seed, require_complete=False)
        assert result.complete != result.closed_early and result.usage.completion_tokens <= max_tokens, result
        assert result.json is not None and result.json.valid, result
        jsonschema.Draft202012Validator(schema).validate(result.parsed)
        if result.closed_early:
            closed += 1
            assert (result.finish_reason, result.close_reason) == ("length", "budget")
    with pytest.raises(ClosedEarly, match=r"^output closed early \(budget\) at \d+ tokens") as info:
        client.generate("Invent a person with a very long name.", constraint=Constraint.json_schema(schema),
                        max_tokens=10, temperature=1.0, seed=0)
    assert info.value.result.json is not None and info.value.result.json.valid
    print(f"max_tokens {max_tokens}: {closed}/3 closed early, the rest finished by the model")


@pytest.mark.parametrize(
    ("extra", "code"),
    [(["--max-tokens", "10"], EXIT_CLOSED), (["--max-tokens", "6", "--on-budget", "truncate"], EXIT_TRUNCATED),
     (["--max-tokens", "48", "--stop", '"age"'], EXIT_TRUNCATED)],
)
def test_cli_exit_code_says_how_the_output_ended(server: TritonServer, extra: list[str], code: int) -> None:
    out, err = io.StringIO(), io.StringIO()
    argv = ["--url", server.grpc_url, "--schema", json.dumps(_schema("person")), *extra, "Invent a person."]
    assert client_main(argv, stdout=out, stderr=err) == code, err.getvalue()
    if code == EXIT_CLOSED:
        jsonschema.Draft202012Validator(_schema("person")).validate(json.loads(out.getvalue()))
        assert err.getvalue().startswith("note: output closed early (budget)")


def test_a_stop_string_never_makes_a_constrained_output_complete(client: Client) -> None:
    constraint = Constraint.json_schema(_schema("person"))
    full = client.generate("Invent a person.", constraint=constraint, max_tokens=48, require_complete=False)
    assert '"age"' in full.text
    with pytest.raises(TruncatedOutput, match=r"^output cut at a stop string") as info:
        client.generate("Invent a person.", constraint=constraint, max_tokens=48, stop=['"age"'])
    result = info.value.result
    assert (result.finish_reason, result.complete, result.stop_string) == ("stop", False, True)
    assert result.text == full.text[: full.text.index('"age"')]
    assert result.json is not None and not result.json.parsed


def test_bad_schema_is_invalid_argument_while_others_complete(client: Client, server: TritonServer) -> None:
    outcomes: dict[str, Any] = {}

    def good(i: int) -> None:
        outcomes[f"good{i}"] = client.generate(PROMPTS[i], constraint=Constraint.regex("[a-z]{3,8}"), max_tokens=20)

    threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    # Valid JSON Schema whose $ref points nowhere: only the server can tell (preprocessing, before any token).
    bad = Constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}))
    try:
        with pytest.raises(InvalidConstraint, match=r"^grammar#/properties/a/\$ref: cannot resolve '#/\$defs/nope'"):
            client.generate("x", constraint=bad, max_tokens=10)
    finally:
        for t in threads:
            t.join()
    assert all(outcomes[f"good{i}"].complete for i in range(3))
    assert wait_active_zero(server) == 0
    assert server.is_running()


def test_eight_concurrent_requests_share_one_batch(client: Client, server: TritonServer) -> None:
    """Eight streams held open by design (their constraint cannot end within max_tokens): once each has
    streamed a token, all eight decode in one batch, so the llm_batch_size gauge must reach 8."""
    never_ends = Constraint.regex(NEVER_ENDS).with_policies(on_repeat="continue")
    outputs_before = counter_sum(server.metrics_url, OUTPUTS)
    streams = [client.stream(PROMPTS[i % 4], constraint=never_ends, max_tokens=1000, require_complete=False)
               for i in range(8)]
    try:
        for stream in streams:
            assert any(chunk.text for chunk in stream), "a stream ended before its first token"
        wait_for(lambda: metric(server, "llm_batch_size") == 8, 60, "llm_batch_size 8")
        assert metric(server, "llm_constrained_sequences") == 8
        assert grammar_active(server) == 8
    finally:
        for stream in streams:
            stream.close()
    wait_for(lambda: sequences_freed(server), 120, "sequences freed after the streams closed")
    assert counter_sum(server.metrics_url, OUTPUTS) == outputs_before


def test_cancelled_stream_frees_its_matcher(client: Client, server: TritonServer) -> None:
    """A closed stream is cancelled inside the server (its constraint cannot end within max_tokens)."""
    outputs_before = counter_sum(server.metrics_url, OUTPUTS)
    never_ends = Constraint.regex(NEVER_ENDS).with_policies(on_repeat="continue")
    stream = client.stream("Write one letter per line.", constraint=never_ends, max_tokens=1000,
                           require_complete=False)
    for chunk in stream:
        if chunk.text:
            break
    assert grammar_active(server) == 1
    stream.close()  # cancels the gRPC call; the gateway cancels the request inside the server
    assert_cancelled(server, outputs_before)


def test_unseeded_requests_are_random_and_replay_by_their_seed(client: Client) -> None:
    """No seed: each request draws its own (reported in RESULT seed), so outputs at temperature 1 differ;
    sent back as SEED, a reported seed replays its output."""
    prompt = "Write one short sentence about the sea."
    results = [client.generate(prompt, max_tokens=24, temperature=1.0, require_complete=False) for _ in range(3)]
    seeds = [r.seed for r in results]
    assert all(isinstance(s, int) and 0 <= s < 2**64 for s in seeds) and len(set(seeds)) == 3, seeds
    assert len({r.text for r in results}) >= 2, [r.text for r in results]
    replay = client.generate(prompt, max_tokens=24, temperature=1.0, seed=seeds[0], require_complete=False)
    assert (replay.text, replay.seed) == (results[0].text, seeds[0])


def test_logprobs_over_grpc_one_entry_per_token_beside_a_request_without(client: Client) -> None:
    """logprobs=3 on constrained requests: one entry per output token (the end token that ended it has
    none), their bytes joined are the text, each logprob <= 0, alternatives (1 to 3, most likely first);
    the chunks' entries join to the result's.  A greedy request without logprobs in the same batch gets
    none and writes what it writes alone."""
    constraint = Constraint.json_schema(_schema("person"))
    plain_prompt = "Count to five."
    alone = client.generate(plain_prompt, max_tokens=24, require_complete=False)
    assert alone.logprobs is None

    def asked(i: int) -> list[Chunk]:
        return list(client.stream(f"{PROMPTS[i]} Reply with JSON.", constraint=constraint, max_tokens=64,
                                  temperature=1.0, seed=i, logprobs=3, require_complete=False))

    def plain() -> list[Chunk]:
        return list(client.stream(plain_prompt, max_tokens=24, require_complete=False))

    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(asked, 0), pool.submit(plain), pool.submit(asked, 1)]
        runs = [job.result(timeout=300) for job in jobs]
    beside = runs.pop(1)
    final = beside[-1].result
    assert final is not None and final.text == alone.text and final.logprobs is None
    assert all(chunk.logprobs is None for chunk in beside)
    for chunks in runs:
        result = chunks[-1].result
        assert result is not None and result.logprobs is not None and result.finish_reason != "error", result
        assert result.logprobs == [e for chunk in chunks for e in chunk.logprobs or ()]
        cut = result.finish_reason == "length" and not result.closed_early  # cut at max_tokens: no end token
        assert len(result.logprobs) == result.usage.completion_tokens - (0 if cut else 1)
        assert b"".join(bytes(e.bytes) for e in result.logprobs) == result.text.encode()
        if not any("\ufffd" in e.token for e in result.logprobs):
            assert "".join(e.token for e in result.logprobs) == result.text
        for e in result.logprobs:
            tops = [t.logprob for t in e.top_logprobs]
            assert e.logprob <= 0.0 and 1 <= len(tops) <= 3 and tops == sorted(tops, reverse=True), e
            assert all(t <= 0.0 for t in tops)


COPIED = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                           "born": {"type": "integer"}},
          "required": ["name", "city", "born"], "additionalProperties": False}


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "json_schema"])
def test_prompt_lookup_speculation_over_grpc_gives_the_text_without_it(client: Client, server: TritonServer,
                                                                       constrained: bool) -> None:
    """An output that copies its prompt, greedy, with DRAFT_TOKENS 6 and 0 (the server's default is off):
    the same text, finish and tokens; the drafts were fed and some kept (the llm model's counters); nothing
    leaks.  Jump-forward is off: how far a step jumps follows the step times the server measures, and a
    jump cut short spells the rest of its forced text under the mask, so with it on two runs of the same
    request can count different tokens for the same text, speculation or not.  The backend is pinned:
    under auto, a replay of the first output may move the schema to xgrammar in between."""
    prompt = ('Copy this record exactly, as JSON: {"name": "Ada Lovelace", "city": "London", "born": 1815}. '
              'Then copy it again: {"name": "Ada Lovelace", "city": "London", "born": 1815}')
    constraint = (Constraint.json_schema(COPIED).with_policies(jump_forward=False, backend="llguidance")
                  if constrained else None)
    plain = client.generate(prompt, constraint=constraint, max_tokens=48, draft_tokens=0, require_complete=False)
    fed, kept = metric(server, "llm_draft_tokens_total"), metric(server, "llm_draft_tokens_kept_total")
    drafted = client.generate(prompt, constraint=constraint, max_tokens=48, draft_tokens=6, require_complete=False)
    assert (drafted.text, drafted.finish_reason, drafted.usage.completion_tokens) == (
        plain.text, plain.finish_reason, plain.usage.completion_tokens)
    assert "Ada Lovelace" in plain.text
    # Published at the next metrics snapshot (at most llm_runtime's interval after the last step).
    assert poll(lambda: metric(server, "llm_draft_tokens_total"), lambda v: v > fed, HANG_S) > fed
    assert poll(lambda: metric(server, "llm_draft_tokens_kept_total"), lambda v: v > kept, HANG_S) > kept
    assert wait_freed(server) == (0, 0.0)


def test_the_grammar_model_answers_draft_positions_through_tritonserver(server: TritonServer) -> None:
    """DRAFT_TOKENS and DRAFT_COUNT in, DRAFT_VALID and DRAFT_BITMASK out, over the grammar model's BLS
    tensors on a real tritonserver: each draft position's mask is the one a plain step reaches by taking
    the same tokens (on a second sequence), and the drafts are not kept."""
    a, b = 9_100_000_001, 9_100_000_002

    def step(seq: int, tokens: list[int], drafts: list[int] | None = None) -> Any:
        inputs = {"OP": np.array([b"step"], np.object_), "SEQUENCE_ID": np.array([seq], np.uint64),
                  "TOKENS": np.array([tokens or [0]], np.int32), "TOKEN_COUNT": np.array([len(tokens)], np.int32)}
        outputs: tuple[str, ...] = ("BITMASK", "TERMINATED")
        if drafts is not None:
            inputs |= {"DRAFT_TOKENS": np.array([drafts], np.int32), "DRAFT_COUNT": np.array([len(drafts)], np.int32)}
            outputs += ("DRAFT_VALID", "DRAFT_BITMASK")
        return grammar_call(server, inputs, outputs)

    for seq in (a, b):
        grammar_call(server, {"OP": np.array([b"start"], np.object_), "SEQUENCE_ID": np.array([seq], np.uint64),
                              "GRAMMAR_TYPE": np.array([b"regex"], np.object_),
                              "GRAMMAR": np.array([b"[ab]{6,8}c"], np.object_)}, ("BACKEND",))
    try:
        # Sequence b, one token a step: the lowest allowed token each time, and the mask after it.
        masks = [step(b, []).as_numpy("BITMASK")[0]]
        taken: list[int] = []
        for _ in range(3):
            taken.append(int(np.flatnonzero(np.unpackbits(masks[-1].view(np.uint8), bitorder="little"))[0]))
            masks.append(step(b, taken[-1:]).as_numpy("BITMASK")[0])
        # Sequence a, its first step with those three tokens as drafts.
        drafted = step(a, [], taken)
        assert drafted.as_numpy("DRAFT_VALID").tolist() == [3]
        assert np.array_equal(drafted.as_numpy("BITMASK")[0], masks[0])
        draft_masks = drafted.as_numpy("DRAFT_BITMASK")
        assert draft_masks.shape == (3, 1, masks[0].shape[0])
        for j in range(3):
            assert np.array_equal(draft_masks[j, 0], masks[j + 1])
        # Not kept: a takes the first token as its own and stands where b stood after it.
        assert np.array_equal(step(a, taken[:1]).as_numpy("BITMASK")[0], masks[1])
    finally:
        grammar_call(server, {"OP": np.array([b"end"], np.object_), "SEQUENCE_ID": np.array([a, b], np.uint64)})
