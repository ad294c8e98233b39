"""The configuration page's table, generated from ``deploy/values.json`` and the model templates.

Every value :mod:`deploy.render` fills into ``model_repository/*/config.pbtxt.in``
gets one row: its default (``values.json``; ``MODEL_DIR`` comes from the
Makefile), the models and parameters it fills, and what it does
(:data:`MEANINGS`, the one place these are written).  The table sits in
``docs/configuration.md`` between two marker lines;
``tests/unit/test_config_doc.py`` fails when it is out of date, or when a value
has no meaning or a meaning no value.

Usage::

    python -m deploy.config_doc            # exit 1 (and say so) when the page is out of date
    python -m deploy.config_doc --write    # rewrite the table in docs/configuration.md
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from deploy.render import TEMPLATE_NAME, load_values

ROOT: Final = Path(__file__).resolve().parent.parent
VALUES: Final = ROOT / "deploy" / "values.json"
TEMPLATES: Final = ROOT / "model_repository"
PAGE: Final = ROOT / "docs" / "configuration.md"
BEGIN: Final = "<!-- BEGIN GENERATED: deploy/config_doc.py -->"
END: Final = "<!-- END GENERATED -->"

#: Values the Makefile sets rather than ``values.json`` (``make render``), with where they come from.
MAKEFILE_VALUES: Final[Mapping[str, str]] = {"MODEL_DIR": "`make model` (`MODEL_DIR`)"}

#: What each value does: the one place it is written (the models' config dataclasses hold the parsing).
MEANINGS: Final[Mapping[str, str]] = {
    "MODEL_DIR": "Local Hugging Face checkpoint folder: the model and its tokenizer (no hub is contacted).",
    "VOCAB_SIZE": "The language model's logits width; `0`: from the checkpoint's `config.json`.",
    "MAX_BATCH": "Most rows of one decode step (and of one grammar step).",
    "GRAMMAR_FILL_THREADS": "Threads that fill one step's bitmask rows (both backends); 0: half the CPUs the "
                            "grammar model may use (affinity and cgroup quota), 1 to 8: 1 on 2 cores, 8 on a 16-core GPU "
                            "node. llguidance builds a grammar whose sequences run side by side up to once per thread "
                            "(copies of one build take turns at its lexer), off the start's path; a heavy constraint "
                            "(`HEAVY_CONSTRAINT_BYTES`) once. Fewer threads than CPUs leave one to the step thread: "
                            "from 128 rows a step's first rows are filled while it plans the rest (the pipelined "
                            "fill). xgrammar's rows take the threads only where their last fill took 0.3 ms or "
                            "more (its call starts its threads each time). See docs/benchmarks.md for the scaling "
                            "measured.",
    "GRAMMAR_COMPILE_WORKERS": "Worker processes that compile grammars.",
    "GRAMMAR_COMPILE_QUEUE": "Distinct compiles that may wait for a worker; beyond, `RESOURCE_EXHAUSTED`.",
    "GRAMMAR_COMPILE_TIMEOUT_S": "How long a request's start waits for its compile.",
    "GRAMMAR_COMPILE_CPU_S": "CPU seconds a compile may use (twice that in wall time) before it is stopped.",
    "GRAMMAR_COMPILE_MEMORY_BYTES": "Memory a compile may use before it is stopped.",
    "GRAMMAR_MAX_GRAMMAR_BYTES": "Largest compiled grammar kept; a larger one is refused (see [limits](limits.md)).",
    "GRAMMAR_CACHE_MAX_BYTES": "Bound on the in-memory cache of compiled grammars.",
    "GRAMMAR_STORE_DIR": "On-disk store of compiled grammars, kept across restarts; empty: none.",
    "GRAMMAR_STORE_MAX_BYTES": "Bound on the store; empty: `grammar_service.cache.STORE_MAX_BYTES` (2 GiB); least recently used "
                               "files are evicted. A failed "
                               "store read or write is a warning and `grammar_store_*_failures_total`, never a "
                               "failed request.",
    "GRAMMAR_IDLE_TTL_S": "A sequence's grammar state with no step for this long is evicted.",
    "MAX_TOKENS_LIMIT": "Largest `max_tokens` a request may ask for.",
    "MAX_PROMPT_TOKENS": "Longest prompt, in tokens.",
    "PROMPT_FORMAT": "`chat`: the tokenizer's chat template (a checkpoint without one is refused at load with "
                     "what to add); `plain`: for a base model, PROMPT as text and MESSAGES refused by name.",
    "REASONING_START": "The model's thinking start marker (`<think>`); empty: the model does not reason.",
    "REASONING_END": "The model's thinking end marker (`</think>`); empty: the model does not reason.",
    "PREPROCESSING_INSTANCES": "`preprocessing` instances (stub processes), each with its own heavy lane.",
    "HEAVY_CONSTRAINT_BYTES": "A constraint larger than this (bytes) is heavy: new to a `preprocessing` instance, it "
                              "is checked in the instance's heavy lane (one thread), so requests behind it are not "
                              "held by its checks (a 1.9 MB schema's take seconds); its compiles leave one compile "
                              "thread of each backend to smaller constraints.",
    "PREPROCESSING_HEAVY_QUEUE": "Large constraints that may wait for an instance's heavy lane; past it "
                                 "`RESOURCE_EXHAUSTED` (the SDK's `ServerBusy`).",
    "PREPROCESSING_CHECK_CPU_S": "CPU seconds the heavy lane's child process (nice 19) may spend checking one "
                                 "constraint; past it `INVALID_ARGUMENT` naming the limit (a 1.9 MB schema needs "
                                 "about 5); past ten times that in wall time, `DEADLINE_EXCEEDED`.",
    "ENGINE": "`torch` (the embedded default) or `tensorrt_llm` (GPU; [GPU](../deploy/gpu/README.md)).",
    "DEVICE": "The torch engine's device (`cpu`, `cuda`).",
    "TORCH_THREADS": "Threads of the torch engine's forward.",
    "LLM_INSTANCES": "`llm` stub processes, sharing the one `grammar` model.",
    "STREAM_INTERVAL_MS": "After the first delta, at most one streamed response per this many milliseconds per "
                          "stream; `0`: every token.",
    "MAX_PREFILL_TOKENS": "torch only: most prompt positions one step prefills (prompts times the longest); "
                          "empty: the default for the device (`llm_runtime.scheduler.DEFAULT_PREFILL_TOKENS`). A longer prompt prefills alone, in chunks of that "
                          "size between decode steps.",
    "DRAFT_TOKENS": "torch only: prompt-lookup speculation for requests that do not set `DRAFT_TOKENS`: at most "
                    "this many tokens copied from the prompt and output verified per forward; `0`: off. Pays "
                    "where outputs copy from their input (docs/benchmarks.md).",
    "GRAMMAR_MODE": "How `llm` consumes the bitmask; empty: the engine's default (table above).",
    "TRTLLM_SAMPLER": "tensorrt_llm only: TensorRT-LLM's `sampler_type`; empty: `TorchSampler` "
                      "([GPU](../deploy/gpu/README.md)).",
    "TRTLLM_SPECULATIVE_CONFIG": "tensorrt_llm only: TensorRT-LLM's `speculative_config` as one JSON object in its "
                                 "`extra_llm_api_options` form, e.g. `{\"decoding_type\": \"NGram\", "
                                 "\"max_draft_len\": 4, \"max_matching_ngram_size\": 2}`; `Eagle`/`Eagle3`, "
                                 "`DraftTarget`, `NGram`, `MTP`; empty: none "
                                 "([GPU](../deploy/gpu/README.md#speculative-decoding)).",
}

#: ``parameters { key: "k" value: { string_value: "${V}" } }`` and any other ``${V}`` in a template.
_PARAMETER_RE: Final = re.compile(r'parameters\s*\{\s*key:\s*"(?P<key>[^"]+)"[^$]*\$\{(?P<value>[A-Za-z_][A-Za-z0-9_]*)\}')
_PLACEHOLDER_RE: Final = re.compile(r"\$\{(?P<value>[A-Za-z_][A-Za-z0-9_]*)\}")
_COUNT_RE: Final = re.compile(r"count:\s*\$\{(?P<value>[A-Za-z_][A-Za-z0-9_]*)\}")


def uses(templates: Path = TEMPLATES) -> dict[str, list[str]]:
    """Each placeholder of the model templates and what it fills: ``model: parameter``, by model name."""
    found: dict[str, list[str]] = {}
    for path in sorted(templates.glob(f"*/{TEMPLATE_NAME}")):
        model = path.parent.name
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.lstrip().startswith("#"):
                continue
            named = {m["value"]: f"`{model}`: `{m['key']}`" for m in _PARAMETER_RE.finditer(line)}
            named |= {m["value"]: f"`{model}`: instances" for m in _COUNT_RE.finditer(line)}
            for m in _PLACEHOLDER_RE.finditer(line):
                found.setdefault(m["value"], []).append(named.get(m["value"], f"`{model}`"))
    return found


def table(values: Mapping[str, str], used: Mapping[str, Sequence[str]]) -> str:
    """The markdown table: one row per value, ``values.json``'s order, then the Makefile's."""
    rows = ["| value | default | fills | what it does |", "|---|---|---|---|"]
    for name in [*values, *(k for k in MAKEFILE_VALUES if k not in values)]:
        default = MAKEFILE_VALUES.get(name) or (f"`{values[name]}`" if values[name] else "empty")
        rows.append(f"| `{name}` | {default} | {', '.join(used.get(name, ())) or 'nothing'} | {MEANINGS[name]} |")
    return "\n".join(rows)


def problems(values: Mapping[str, str], used: Mapping[str, Sequence[str]]) -> list[str]:
    """What keeps the table from being whole: a value without a meaning, a meaning without a value."""
    names = set(values) | set(used) | set(MAKEFILE_VALUES)
    out = [f"{name}: no meaning in deploy.config_doc.MEANINGS" for name in sorted(names - set(MEANINGS))]
    out += [f"{name}: a meaning, but no such value" for name in sorted(set(MEANINGS) - names)]
    return out


def render_page(page: str, generated: str) -> str:
    """``page`` with its marked block replaced by ``generated``.

    Raises
    ------
    ValueError
        The page lacks the two marker lines, in order.
    """
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{PAGE.relative_to(ROOT)}: no {BEGIN!r} ... {END!r} block")
    return f"{page[:start]}{BEGIN}\n\n{generated}\n\n{page[end:]}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.config_doc", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/configuration.md")
    args = parser.parse_args(argv)
    values, used = load_values(VALUES), uses()
    missing = problems(values, used)
    if missing:
        print("\n".join(missing), file=sys.stderr)
        return 1
    page = PAGE.read_text(encoding="utf-8")
    wanted = render_page(page, table(values, used))
    if wanted == page:
        return 0
    if args.write:
        PAGE.write_text(wanted, encoding="utf-8")
        return 0
    print(f"{PAGE.relative_to(ROOT)} is out of date: python -m deploy.config_doc --write", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
