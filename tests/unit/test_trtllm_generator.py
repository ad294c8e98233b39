"""TrtllmGenerator, the llm model's TensorRT-LLM engine, over TensorRT-LLM's executor as emulated (no GPU here).

The engine, its grammar decoder (``GrammarModelDecoder``, the real subclass)
and the grammar rows are the project's code as it runs on a GPU host; below
them, :mod:`tests.support.trtllm_emulation` stands in for the LLM API and the
executor loop in TensorRT-LLM's order, with the tiny torch model's forward and
the real grammar engine behind the rows.  What this cannot show (TensorRT-LLM's
own timing, CUDA, the real package's private API) is the first GPU host's:
``deploy/gpu/preflight.sh`` and ``make test-gpu``.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import llm_runtime
from grammar_backend.errors import ConfigError
from grammar_service.engine import GrammarEngine
from llm_runtime import trtllm_engine
from llm_runtime.engine import TorchEngine, TorchEngineConfig
from llm_runtime.errors import RequestError
from llm_runtime.local_mask import LocalMaskProvider
from llm_runtime.mask import ConstraintRequest
from llm_runtime.scheduler import FinishEvent, GenerationRequest, TokenEvent
from llm_runtime.trtllm_api import TRTLLM_VERSION
from llm_runtime.trtllm_engine import TrtllmConfig, TrtllmGenerator
from llm_runtime.trtllm_speculative import parse_speculative_config
from standins.tiny_model import TinyModelInfo, tiny_grammar
from tests.support.poll import wait_for
from tests.support.trtllm_emulation import GuidedDecoder, Trtllm, install

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHOICE = ConstraintRequest("choice", '["north", "south"]', "")


@pytest.fixture(scope="module")
def engine(tiny: TinyModelInfo) -> TorchEngine:
    return TorchEngine(tiny.path, TorchEngineConfig(max_batch_size=8, max_seq_len=320))


@pytest.fixture
def grammar(tiny: TinyModelInfo) -> Iterator[GrammarEngine]:
    g = tiny_grammar(tiny, max_batch=8)
    yield g
    assert g.active_count == 0, "a grammar sequence leaked"
    g.close()


@pytest.fixture
def trtllm(monkeypatch: pytest.MonkeyPatch, engine: TorchEngine) -> Iterator[Callable[..., Trtllm]]:
    """Install the emulated package; the engine's import gate returns it (the real one also asks for CUDA)."""

    def start(**kwargs: object) -> Trtllm:
        made = install(monkeypatch, engine, **kwargs)  # type: ignore[arg-type]
        monkeypatch.delattr(llm_runtime, "trtllm_decoder", raising=False)
        monkeypatch.setattr(trtllm_engine, "import_tensorrt_llm", lambda: made.module)
        return made

    yield start
    # The decoder module was imported against the emulated classes: never reuse it.
    sys.modules.pop("llm_runtime.trtllm_decoder", None)
    if hasattr(llm_runtime, "trtllm_decoder"):
        delattr(llm_runtime, "trtllm_decoder")


class Events:
    """A request's events, and its finish."""

    def __init__(self) -> None:
        self.tokens: list[TokenEvent] = []
        self.finish: FinishEvent | None = None
        self.done = threading.Event()

    def __call__(self, event: TokenEvent | FinishEvent) -> None:
        if isinstance(event, FinishEvent):
            self.finish = event
            self.done.set()
        else:
            self.tokens.append(event)

    def wait(self) -> FinishEvent:
        assert self.done.wait(120), "no FinishEvent"
        assert self.finish is not None
        return self.finish


def generator(tiny: TinyModelInfo, grammar: GrammarEngine) -> TrtllmGenerator:
    return TrtllmGenerator(TrtllmConfig(model_dir=str(tiny.path), max_batch=8, max_seq_len=320),
                           LocalMaskProvider(grammar))


def ticked(executor: Any, events: Events) -> FinishEvent:
    """Run the manual executor one iteration at a time, the engine reacting to each before the next, until
    the request (the last one submitted) has its finish."""
    while not events.done.is_set():
        executor.tick()
        if executor.results[-1].done:  # its final output was taken: the finish follows
            break
    return events.wait()


def test_a_stop_string_ends_a_constrained_request_cleanly(trtllm: Callable[..., Trtllm], tiny: TinyModelInfo,
                                                          grammar: GrammarEngine, engine: TorchEngine) -> None:
    """A stop string inside a constrained output ends the request before TensorRT-LLM's final output: the
    client gets its finish at once; the next iteration still schedules and builds the request (it fetches the
    abort at its start), and fails nothing; its row goes when TensorRT-LLM's final output for it comes."""
    made = trtllm(manual=True)
    gen = generator(tiny, grammar)
    try:
        executor = made.executor
        assert executor is not None
        prompt = engine.tokenizer.encode("hello world").ids
        regex = ConstraintRequest("regex", "[a-z]{12,20}", "")
        whole = Events()
        gen.submit(GenerationRequest(prompt, constraint=regex, max_tokens=24, temperature=0.0), whole)
        text = ticked(executor, whole).text
        stop = text[5:7]  # greedy: the same output again, cut where this first appears
        stopped = Events()
        gen.submit(GenerationRequest(prompt, constraint=regex, max_tokens=24, temperature=0.0, stop=(stop,)),
                   stopped)
        fin = ticked(executor, stopped)
        assert (fin.finish_reason, fin.stop_string, fin.error, fin.text) == ("stop", True, None,
                                                                            text[:text.index(stop)])
        assert gen._rows is not None
        held = gen._rows.row_count  # retired, not removed: TensorRT-LLM still holds the request
        executor.tick()  # fetches the abort, builds the request once more, sends its final output
        assert (executor.failed, held) == ([], 1)
        wait_for(lambda: gen._rows is not None and gen._rows.row_count == 0, 60, "the row removed at the final output")
        assert grammar.active_count == 0
    finally:
        gen.close()


def test_a_cancelled_constrained_request_ends_cancelled(trtllm: Callable[..., Trtllm], tiny: TinyModelInfo,
                                                        grammar: GrammarEngine, engine: TorchEngine) -> None:
    made = trtllm(manual=True)
    gen = generator(tiny, grammar)
    try:
        executor = made.executor
        assert executor is not None
        events = Events()
        regex = ConstraintRequest("regex", "[a-z ]{40,60}", "")
        rid = gen.submit(GenerationRequest(engine.tokenizer.encode("yes no").ids, constraint=regex, max_tokens=64,
                                           temperature=0.0), events)
        executor.tick()
        executor.tick()
        assert (len(events.tokens), gen.cancel(rid)) == (2, True)
        fin = ticked(executor, events)  # the next iteration fetches the cancel and sends the final output
        assert (fin.finish_reason, fin.status, fin.error) == ("error", "CANCELLED", "request cancelled")
        assert gen._rows is not None and gen._rows.row_count == 0
        assert executor.failed == []
    finally:
        gen.close()


SPECULATIVE = [
    pytest.param('{{"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "{draft}"}}',
                 "EagleDecodingConfig", "EAGLE3_ONE_MODEL", 3, id="eagle3"),
    pytest.param('{{"decoding_type": "MTP", "num_nextn_predict_layers": 2}}', "MTPDecodingConfig",
                 "MTP_EAGLE_ONE_MODEL", 2, id="mtp"),
]


@pytest.mark.parametrize(("text", "cls", "mode", "drafts"), SPECULATIVE)
def test_the_speculative_setting_runs_through_the_grammar_decoder(
        trtllm: Callable[..., Trtllm], tiny: TinyModelInfo, grammar: GrammarEngine, engine: TorchEngine,
        text: str, cls: str, mode: str, drafts: int) -> None:
    """TRTLLM_SPECULATIVE_CONFIG end to end over the emulated executor: the engine hands LLM(...) the llmapi
    class built from it (the draft model under 1.2.1's name), TensorRT-LLM lays out its draft rows, its
    one-model decoder is the grammar's, drafts are proposed, and the greedy outputs and finishes are those
    without speculation."""
    prompt = engine.tokenizer.encode("hello world").ids
    requests = [GenerationRequest(prompt, constraint=c, max_tokens=24, temperature=0.0)
                for c in (CHOICE, ConstraintRequest("regex", "[a-z]{8,16}", ""))]

    def outputs(gen: TrtllmGenerator) -> list[tuple[str, str | None, str | None]]:
        try:
            done: list[tuple[str, str | None, str | None]] = []
            for request in requests:
                events = Events()
                gen.submit(request, events)
                fin = events.wait()
                done.append((fin.text, fin.finish_reason, fin.error))
            return done
        finally:
            gen.close()

    trtllm()
    plain = outputs(generator(tiny, grammar))
    made = trtllm()
    speculative = parse_speculative_config(text.format(draft=tiny.path))
    gen = TrtllmGenerator(TrtllmConfig(model_dir=str(tiny.path), max_batch=8, max_seq_len=320,
                                       speculative=speculative), LocalMaskProvider(grammar))
    built = gen._llm.kwargs["speculative_config"]
    assert type(built).__name__ == cls and built.mode == mode
    if cls == "EagleDecodingConfig":
        assert (built.speculative_model, built.max_draft_len) == (str(tiny.path), 3)
    decoder = gen._llm._executor.engine.model_engine.guided_decoder
    assert (type(decoder).__name__, decoder.max_num_draft_tokens) == ("GrammarCapturableDecoder", drafts)
    assert outputs(gen) == plain
    assert made.executor is not None and made.executor.tally.drafted > 0  # type: ignore[attr-defined]


class FailingSteps(LocalMaskProvider):
    """The grammar side failing its steps once ``fail`` is set (the grammar model gone, say)."""

    fail = False

    def step(self, seq_ids: Any, tokens: Any, counts: Any, jump_forward: bool = False, drafts: Any = None,
             draft_counts: Any = None) -> Any:
        if self.fail:
            raise RuntimeError("grammar model unreachable")
        return super().step(seq_ids, tokens, counts, jump_forward)


def test_a_failed_grammar_row_ends_its_request_at_once_with_the_rows_error(
        trtllm: Callable[..., Trtllm], tiny: TinyModelInfo, grammar: GrammarEngine, engine: TorchEngine) -> None:
    """The decoder fails the row; TensorRT-LLM answers with an error response and sends nothing more: the
    request ends with the row's error and its row is removed, not retired to wait for a final output."""
    made = trtllm(manual=True)
    provider = FailingSteps(grammar)
    gen = TrtllmGenerator(TrtllmConfig(model_dir=str(tiny.path), max_batch=8, max_seq_len=320), provider)
    try:
        executor = made.executor
        assert executor is not None
        events = Events()
        gen.submit(GenerationRequest(engine.tokenizer.encode("yes no").ids,
                                     constraint=ConstraintRequest("regex", "[a-z]{8,12}", ""), max_tokens=16,
                                     temperature=0.0), events)
        executor.tick()
        provider.fail = True
        executor.tick()
        fin = events.wait()
        assert (fin.finish_reason, fin.status, fin.error) == ("error", "INTERNAL",
                                                              "grammar step failed: grammar model unreachable")
        assert gen._rows is not None and gen._rows.row_count == 0  # removed with the finish, not retired
        assert executor.failed == [(1, "grammar step failed: grammar model unreachable")]
        assert not gen._live
    finally:
        gen.close()


class NoTokenMask(GuidedDecoder):
    """A TensorRT-LLM whose decoder no longer makes ``token_mask_host`` (an instance attribute)."""

    buffers = ("bitmask_host",)


def test_the_grammar_decoder_refuses_a_decoder_without_its_host_buffers(trtllm: Callable[..., Trtllm],
                                                                        tiny: TinyModelInfo,
                                                                        grammar: GrammarEngine) -> None:
    """check_trtllm_api reads the classes; the buffers are made in __init__: checked there, with the
    configuration error, not an AttributeError on the first step."""
    trtllm(decoder_cls=NoTokenMask)
    with pytest.raises(ConfigError, match=rf"not the {TRTLLM_VERSION} API this engine hooks: "
                                          r"GuidedDecoder\.token_mask_host is missing$"):
        generator(tiny, grammar)


@pytest.mark.parametrize(
    ("buffers", "message"),
    [
        ({"bitmask_host": "cuda", "token_mask_host": (4,)}, r"GuidedDecoder\.bitmask_host is not a host tensor"),
        ({"bitmask_host": (4, 2), "token_mask_host": (4,)}, r"bitmask_host has 2 words per row, the vocabulary needs 3"),
        ({"bitmask_host": (4, 3), "token_mask_host": (5,)}, r"token_mask_host has 5 rows, bitmask_host 4"),
        ({"bitmask_host": (4, 3, 1), "token_mask_host": (4,)},
         r"bitmask_host is int32 \(4, 3, 1\), expected int32 with 2 dimensions"),
    ],
)
def test_host_buffers_names_what_differs(buffers: dict[str, tuple[int, ...] | str], message: str) -> None:
    import types

    import torch

    from llm_runtime.trtllm_api import host_buffers

    decoder = types.SimpleNamespace(**{
        name: types.SimpleNamespace(numpy=functools.partial(_cuda_numpy, name)) if isinstance(shape, str)
        else torch.zeros(shape, dtype=torch.int32)
        for name, shape in buffers.items()})
    with pytest.raises(ConfigError, match=message):
        host_buffers(decoder, 3)


def _cuda_numpy(name: str) -> None:
    raise TypeError(f"can't convert cuda:0 device type tensor {name} to numpy")


@pytest.mark.parametrize("seed", [None, 5])
def test_the_seed_is_reported_and_logprobs_and_drafts_refused_by_name(trtllm: Callable[..., Trtllm], tiny: TinyModelInfo,
                                                           grammar: GrammarEngine, engine: TorchEngine,
                                                           seed: int | None) -> None:
    """The seed TensorRT-LLM samples with (drawn where the request has none) is the finish's; logprobs are
    refused at admission, naming the field and why, rather than passed off (trtllm_engine.TRTLLM_LOGPROBS_REFUSAL),
    and so is a request's own prompt-lookup speculation."""
    trtllm()
    gen = generator(tiny, grammar)
    try:
        prompt = engine.tokenizer.encode("hello world").ids
        with pytest.raises(RequestError, match=r"^logprobs: not served by the tensorrt_llm engine \(TensorRT-LLM "
                                               r"1\.2\.1's log probabilities are not checked to be this field's: "):
            gen.submit(GenerationRequest(prompt, constraint=CHOICE, max_tokens=8, logprobs=0), Events())
        with pytest.raises(RequestError, match=r"^draft_tokens: prompt-lookup speculation is the torch engine's; "
                                               r"TensorRT-LLM speculates for every request as the server sets it "
                                               r"\(TRTLLM_SPECULATIVE_CONFIG\)$"):
            gen.submit(GenerationRequest(prompt, constraint=CHOICE, max_tokens=8, draft_tokens=4), Events())
        events = Events()
        gen.submit(GenerationRequest(prompt, constraint=CHOICE, max_tokens=8, temperature=1.0, seed=seed), events)
        fin = events.wait()
        assert fin.finish_reason == "stop" and fin.text in ("north", "south")
        assert fin.seed == seed if seed is not None else isinstance(fin.seed, int) and 0 <= fin.seed < 2**64
    finally:
        gen.close()
