"""The thinking section through the decode loop: Scheduler + LocalMaskProvider(GrammarEngine) + a real model.

The tiny random Llama never writes ``</think>`` (several tokens of its
vocabulary): every thinking section here is ended by the server, and the
answer must still be complete and valid within ``max_tokens``.  The schema
has no free string: a random model writes strings of split UTF-8 characters,
inside which budget closing cannot start a completion (a limit of
:mod:`grammar_backend.closing`, with or without a thinking section).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from contract.reasoning import Reasoning, ReasoningSplitter, split_reasoning
from grammar_backend.spec import parse_constraint
from grammar_service.engine import GrammarEngine, GrammarEngineConfig
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ConstraintRequest
from llm_runtime.scheduler import FinishEvent, GenerationRequest, Scheduler, SchedulerConfig, TokenEvent
from llm_runtime.streaming import PartCoalescer
from pipeline.finish import finish_json
from pipeline.postprocess import result_of_finish
from standins.tiny_model import TinyModelInfo, build_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

THINK = Reasoning(end="</think>", start="<think>")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "c": {"enum": ["red", "green"]}},
          "required": ["n", "c"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModelInfo:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def engine(tiny: TinyModelInfo) -> TorchEngine:
    return TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=8, max_seq_len=320))


@pytest.fixture(scope="module")
def hf(tiny: TinyModelInfo) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny.path), local_files_only=True)


@pytest.fixture(scope="module")
def grammar(tiny: TinyModelInfo, hf: Any) -> Iterator[GrammarEngine]:
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tiny.vocab_size, stop_token_ids=[tiny.eos_token_id])
    special = [i for i, t in hf.added_tokens_decoder.items() if t.special]
    eng = GrammarEngine(info, "tiny", GrammarEngineConfig(max_batch=8),
                        encode=lambda text: hf.encode(text, add_special_tokens=False), special_ids=special)
    yield eng
    eng.close()


@dataclass
class Result:
    """One request's events (the deltas must add up to the text)."""

    events: list[TokenEvent | FinishEvent] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event: TokenEvent | FinishEvent) -> None:
        self.events.append(event)
        if isinstance(event, FinishEvent):
            self.done.set()

    def wait(self) -> FinishEvent:
        assert self.done.wait(120), "request did not finish"
        fin = self.events[-1]
        assert isinstance(fin, FinishEvent)
        assert "".join(e.text_delta for e in self.events if isinstance(e, TokenEvent)) == fin.text
        return fin

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if isinstance(e, TokenEvent) for t in e.token_ids]


def submit(s: Scheduler, req: GenerationRequest) -> Result:
    r = Result()
    s.submit(req, r)
    return r


def prompt(engine: TorchEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text).ids)


def wire(reasoning: Reasoning, **options: Any) -> dict[str, str]:
    spec = parse_constraint("json_schema", json.dumps(SCHEMA), options)
    return dataclasses.replace(spec, options=dataclasses.replace(spec.options, reasoning=reasoning)).wire()


def test_reasoning_marker_is_several_tokens_here(hf: Any) -> None:
    assert len(hf.encode("</think>", add_special_tokens=False)) > 1


def fits(grammar: GrammarEngine) -> int:
    """The least ``max_tokens`` that holds the end marker, the shortest answer and the stop token."""
    rest = grammar.marker_table("</think>").rest(0)
    shortest = grammar.closer.complete(xgr.GrammarMatcher(grammar.compile(parse_constraint("json_schema",
                                                                                           json.dumps(SCHEMA)))))
    assert rest is not None and shortest is not None
    return len(rest) + len(shortest) + 1


@pytest.mark.parametrize("extra", [0, 1, 3, 10, 40])
def test_reasoning_the_server_ends_the_thinking_and_the_answer_is_valid(
        engine: TorchEngine, grammar: GrammarEngine, hf: Any, extra: int) -> None:
    """From the least budget that holds a valid answer up, every answer is complete and valid."""
    max_tokens = fits(grammar) + extra
    constraint = wire(THINK)
    with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
        results = [submit(s, GenerationRequest(
            prompt(engine, "x"), max_tokens=max_tokens, temperature=1.0, seed=i,
            constraint=ConstraintRequest(constraint["kind"], constraint["payload"], constraint["options"],
                                         validated=True))) for i in range(4)]
        finals = [r.wait() for r in results]
    for r, fin in zip(results, finals, strict=True):
        assert fin.completion_tokens <= max_tokens and fin.reasoning_cut
        thinking, answer, ended = split_reasoning(fin.text, THINK)
        assert ended, fin.text
        jsonschema.validate(json.loads(answer), SCHEMA)
        # The reasoning tokens are the output's first ones, the forced marker their last.
        ids = r.token_ids
        assert fin.reasoning_tokens is not None and 0 < fin.reasoning_tokens < len(ids)
        head = hf.decode(ids[: fin.reasoning_tokens], skip_special_tokens=True)
        assert head.endswith("</think>") and "</think>" not in head[:-len("</think>")]
        assert hf.decode(ids[fin.reasoning_tokens:], skip_special_tokens=True) == answer
        # The stream, split as the llm model splits it, gives the same parts.
        coalescer = PartCoalescer(0.0, ReasoningSplitter(THINK))
        parts = [coalescer.push(e.text_delta) for e in r.events if isinstance(e, TokenEvent)]
        parts.append(coalescer.finish())
        assert ("".join(p[0] for p in parts if p), "".join(p[1] for p in parts if p)) == (thinking, answer)
        # postprocessing reads the answer alone
        result = json.loads(result_of_finish(finish_json(fin, constraint, THINK).encode()).result)
        assert (result["text"], result["reasoning"], result["reasoning_tokens"], result["reasoning_cut"],
                result["reasoning_ended"]) == (answer, thinking, fin.reasoning_tokens, True, True)
        assert result["json"]["valid"] is True
    assert grammar.active_count == 0


@pytest.mark.parametrize("limit", [1, 5, 9])
def test_reasoning_max_reasoning_tokens_through_the_scheduler(engine: TorchEngine, grammar: GrammarEngine,
                                                              hf: Any, limit: int) -> None:
    marker = len(hf.encode("</think>", add_special_tokens=False))
    constraint = wire(Reasoning(end="</think>", max_reasoning_tokens=limit))
    with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
        fin = submit(s, GenerationRequest(
            prompt(engine, "x"), max_tokens=128, temperature=1.0, seed=3,
            constraint=ConstraintRequest(constraint["kind"], constraint["payload"], constraint["options"],
                                         validated=True))).wait()
    assert fin.reasoning_cut and fin.reasoning_tokens == max(limit, marker)
    assert split_reasoning(fin.text, THINK)[2]


def test_reasoning_without_a_constraint_is_not_counted(engine: TorchEngine, grammar: GrammarEngine) -> None:
    """No grammar state: the scheduler has nothing to count (the output is still split downstream)."""
    with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
        fin = submit(s, GenerationRequest(prompt(engine, "x"), max_tokens=8, temperature=1.0, seed=1)).wait()
    assert (fin.reasoning_tokens, fin.reasoning_cut) == (None, False)
    result = json.loads(result_of_finish(finish_json(fin, None, THINK).encode()).result)
    assert result["reasoning_tokens"] is None and result["reasoning_ended"] is ("</think>" in fin.text)
    assert result["complete"] is False or "</think>" in fin.text


def test_reasoning_result_is_unchanged_without_the_option(engine: TorchEngine, grammar: GrammarEngine) -> None:
    """A request without a thinking section: the same RESULT members as before the option existed."""
    constraint = parse_constraint("json_schema", json.dumps(SCHEMA)).wire()
    assert "reasoning" not in json.loads(constraint["options"])
    with Scheduler(engine, LocalMaskProvider(grammar), SchedulerConfig(max_batch_size=8)) as s:
        fin = submit(s, GenerationRequest(
            prompt(engine, "x"), max_tokens=24, temperature=1.0, seed=5,
            constraint=ConstraintRequest(constraint["kind"], constraint["payload"], constraint["options"],
                                         validated=True))).wait()
    assert (fin.reasoning_tokens, fin.reasoning_cut) == (None, False)
    finish = json.loads(finish_json(fin, constraint))
    assert "reasoning" not in finish
    result = json.loads(result_of_finish(finish_json(fin, constraint).encode()).result)
    assert list(result) == ["finish_reason", "complete", "closed_early", "close_reason", "stop_string", "backend",
                            "value_retries", "value_dropped_tokens", "text", "usage", "error", "status", "json",
                            "seed"]
    assert (result["text"], result["seed"]) == (fin.text, 5)
