"""Closing for every constraint kind, through the real engine, with SmolLM2's and Qwen3's vocabularies.

Each case is a failure pattern found by ported peer suites and real
clients (issue 47): a forced ending that holds a control character, a
runaway inside a regex or a grammar, several tool calls cut by the budget,
whitespace in tool arguments.  A scripted model (:mod:`standins.scripted`)
writes the runaway; the output must end complete under its constraint
(the grammar takes the stop token) and, where a Python pattern states the
same language, match it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from grammar_backend.bitmask import allowed_tokens
from grammar_backend.fidelity import validate_output
from grammar_backend.llg import LlgBackend
from grammar_backend.protocol import CloseState
from grammar_backend.spec import parse_constraint
from grammar_backend.tokenizer import TokenizerBundle, load_tokenizer
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from openai_api.tools import CALL_CLOSE, CALL_OPEN, Tool, call_prefix, tool_constraint
from standins.scripted import Replay, replay
from tests.support import assets

VOCABULARIES = ("smollm2", "qwen3")


@pytest.fixture(scope="module", params=VOCABULARIES)
def vocab(request: pytest.FixtureRequest) -> Iterator[tuple[TokenizerBundle, GrammarEngine]]:
    folder = assets.smollm2_dir() if request.param == "smollm2" else assets.qwen3_dir()
    bundle = load_tokenizer(str(folder))
    engine = GrammarEngine(bundle.info, bundle.fingerprint, GrammarEngineConfig(max_batch=1), encode=bundle.encode,
                           llg=LlgBackend(bundle.hf, bundle.info.vocab_size, bundle.info.stop_token_ids))
    yield bundle, engine
    engine.close()


def _replay(vocab: tuple[TokenizerBundle, GrammarEngine], kind: str, payload: str, options: dict[str, Any],
            script: str, loop: str, budget: int) -> Replay:
    bundle, engine = vocab
    return replay(engine, lambda ids: str(bundle.hf.decode(ids)),
                  lambda text: list(bundle.hf.encode(text, add_special_tokens=False)), 1,
                  parse_constraint(kind, payload, options), script, loop, budget)


JSON_REGEX = r'\{\n   "name": "[\w]+",\n   "population": [\d]+\n\}'

#: (kind, payload, Python pattern of the same language, script, loop).
RUNAWAYS = [
    ("regex", r"\{[0-9]+\}", r"\{[0-9]+\}", "{", "1"),
    ("regex", r"\{[0-9]+\n\}", r"\{[0-9]+\n\}", "{", "1"),
    ("regex", r"\{[0-9]+\tX", r"\{[0-9]+\tX", "{", "1"),
    ("regex", r"[a-z]+\n", r"[a-z]+\n", "", "ab"),
    ("regex", JSON_REGEX, r'\{\n   "name": "\w+",\n   "population": \d+\n\}', '{\n   "name": "Paris",\n   "population": ',
     "1"),
    ("regex", "[0-9]+€", "[0-9]+€", "", "7"),  # a character outside the search's alphabet ends it
    ("regex", '.+"', '.+"', "", "x"),  # a quote that is content, then the one that ends it
    ("ebnf", 'root ::= "{" [0-9]+ "\\n}"', r"\{[0-9]+\n\}", "{", "1"),
    ("lark", 'start: "{" /[0-9]+/ "\\n}"', r"\{[0-9]+\n\}", "{", "1"),
    ("ebnf", 'root ::= ("ab" | "cd")+ "\\t;"', r"(ab|cd)+\t;", "", "abcd"),
]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize(("kind", "payload", "pattern", "script", "loop"), RUNAWAYS)
# At the budget a regex's calm row is screened (GrammarSequence.screen): the scripted model, refused, takes
# the completion's token itself, so the output may end complete without a forced close.
@pytest.mark.parametrize(("budget", "on_repeat", "closed"), [(128, "close", (CloseState.REPETITION,)),
                                                              (40, "continue", (CloseState.BUDGET, None))])
def test_a_runaway_in_every_kind_is_closed_complete(
    vocab: tuple[TokenizerBundle, GrammarEngine], backend: str, kind: str, payload: str, pattern: str, script: str,
    loop: str, budget: int, on_repeat: str, closed: tuple[CloseState | None, ...],
) -> None:
    out = _replay(vocab, kind, payload, {"backend": backend, "on_repeat": on_repeat}, script, loop, budget)
    assert out.stopped and out.closed in closed, out
    assert out.tokens <= budget
    assert re.fullmatch(pattern, out.text), out.text


METRICS = Tool("get_metrics", "", {"type": "object", "properties": {
    "names": {"type": "array", "items": {"type": "string"}}, "window": {"type": "integer"}},
    "required": ["names", "window"], "additionalProperties": False}, True)


def _calls(count: int, items: int = 4) -> str:
    """``count`` calls of get_metrics as a model writes them (one space after each separator)."""
    def one(i: int) -> str:
        names = ", ".join(f'"metric_{i}_{j}"' for j in range(items))
        return f'{call_prefix(METRICS.name)}{{"names": [{names}], "window": 30}}}}{CALL_CLOSE}'
    return "\n".join(one(i) for i in range(count))


def _parsed_calls(text: str) -> list[Any]:
    """The arguments of each call in ``text``, parsed (every call must be complete)."""
    parts = text.split(CALL_OPEN)[1:]
    assert all(p.rstrip("\n").endswith(CALL_CLOSE) for p in parts), text
    prefix = call_prefix(METRICS.name)[len(CALL_OPEN):]
    return [json.loads(p.strip()[len(prefix):-len("}" + CALL_CLOSE)]) for p in parts]


@pytest.mark.parametrize("share", [0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
def test_several_required_calls_cut_by_the_budget_end_complete(
    vocab: tuple[TokenizerBundle, GrammarEngine], share: float
) -> None:
    """Three parallel calls under ``tool_choice: required``: at every budget that holds one call, each call
    written is complete and valid, and no call is opened that the budget cannot hold."""
    bundle, _ = vocab
    text = _calls(3)
    budget = int(len(bundle.hf.encode(text, add_special_tokens=False)) * share) + 1
    constraint = tool_constraint([METRICS], "required", parallel=True)
    out = _replay(vocab, "structural_tag", constraint.payload, {}, text, "", budget)
    assert out.stopped and out.tokens <= budget, out
    calls = _parsed_calls(out.text)
    assert calls and all(validate_output(METRICS.parameters, json.dumps(c)).valid for c in calls), out.text


@pytest.mark.parametrize("loop", ["\n ", " ", "\n"])
def test_whitespace_in_tool_arguments_is_bounded(vocab: tuple[TokenizerBundle, GrammarEngine], loop: str) -> None:
    """``[\\n "metrics",\\n \\n \\n ...``: the arguments' whitespace runs stay within contract.TAG_WHITESPACE_RUN,
    so the runaway cannot burn the budget on whitespace; the call still ends complete."""
    constraint = tool_constraint([METRICS], "required", parallel=False)
    out = _replay(vocab, "structural_tag", constraint.payload, {}, call_prefix(METRICS.name) + '{"names": [', loop, 64)
    assert out.stopped, out
    arguments = out.text[len(call_prefix(METRICS.name)):]
    assert max(len(run) for run in re.findall(r"\s+", arguments)) == 1, arguments
    assert len(_parsed_calls(out.text)) == 1


LONG = "the second and much longer answer of the two"


@pytest.mark.parametrize(("slack", "long_allowed"), [(0, False), (1, True), (3, True)])
def test_a_choice_near_its_budget_keeps_the_alternatives_that_fit(
    vocab: tuple[TokenizerBundle, GrammarEngine], slack: int, long_allowed: bool
) -> None:
    """A calm choice row is screened token by token (GrammarSequence.screen): the long alternative stays allowed
    exactly while it and the stop token fit the budget, and the short one always does."""
    bundle, engine = vocab
    encode = lambda text: list(bundle.hf.encode(text, add_special_tokens=False))
    budget = len(encode(LONG)) + slack  # the long answer and its stop token need len + 1
    engine.start(1, parse_constraint("choice", json.dumps(["no", LONG])), budget=budget)
    try:
        out = engine.step(np.array([1], np.uint64), np.zeros((1, 1), np.int32), np.zeros(1, np.int32))
        # Calm where the spare is small; with more slack the row may be open (nothing screened).
        assert out.errors == (None,) and out.closing[0] in (CloseState.CALM, CloseState.OPEN)
        assert out.closing[0] == CloseState.CALM or long_allowed
        texts = [str(bundle.hf.decode([t])) for t in allowed_tokens(out.bitmask[0], engine.vocab_size).tolist()]
        assert any(LONG.startswith(t) for t in texts) is long_allowed, texts
        assert any("no".startswith(t) for t in texts), texts
    finally:
        engine.end([1])
