#!/usr/bin/env bash
# Render the model repository for this container's settings, then run the
# supervised server (gateway on 0.0.0.0:8001, the OpenAI-compatible API on 8080, Triton's HTTP 8000 and metrics
# 8002, probe endpoints 8003: deploy/health.py).  Settings come from the environment (defaults in deploy/docker/Dockerfile
# for the GPU image, deploy/docker/Dockerfile.cpu for the CPU one):
#   ENGINE, DEVICE    torch + cpu (CPU image) or tensorrt_llm + cuda (GPU image)
#   MODEL_DIR         Hugging Face checkpoint folder (the model, its tokenizer and end tokens)
#   GRAMMAR_MODE      torch: overlap | processor; tensorrt_llm: processor | native ("" = the engine's default)
#   GRAMMAR_PYTHON_ENV  a Python environment (directory with bin/activate) for the grammar,
#                     preprocessing and postprocessing stubs (Triton's EXECUTION_ENV_PATH); the GPU
#                     image sets it, so TensorRT-LLM keeps its own xgrammar in the llm model's env
#   LAUNCHER_PYTHON   the interpreter of the launcher and gateway (default python3); the llm
#                     model's stub always sees the environment of the python3 on PATH
#   MAX_BATCH         decode batch
#   PROMPT_FORMAT     chat (the checkpoint's chat template; default) | plain (a base model: PROMPT as text)
#   TRTLLM_SAMPLER    tensorrt_llm: TorchSampler (default; applies no penalty, such requests are refused) | TRTLLMSampler
#   TRTLLM_SPECULATIVE_CONFIG  tensorrt_llm: TensorRT-LLM's speculative_config as one JSON object, e.g.
#                     {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2} (default empty: none)
#   STREAM_INTERVAL_MS  least milliseconds between a stream's responses after the first (default 50; 0: every token)
#   MAX_PREFILL_TOKENS  torch: most prompt positions one step prefills (empty: the scheduler's default, 256)
#   REASONING_START, REASONING_END  the model's thinking markers, e.g. <think> and </think> (empty: it does not
#                     reason); with them every request thinks first unless it says reasoning false
#   GRAMMAR_STORE_MAX_BYTES  bound of the compiled-grammar store (empty: the grammar model's default, 2 GiB)
#   GRAMMAR_FILL_THREADS  threads of the grammar step's mask fill (default 0: half the container's CPUs, 1 to 8)
#   GATEWAY_TLS_CERT, GATEWAY_TLS_KEY, GATEWAY_TLS_CLIENT_CA, GATEWAY_API_KEYS_FILE
#                     TLS and API keys of the public ports (read by the launcher, python -m deploy; empty: off)
#   OPENAI_PORT       the OpenAI-compatible API (openai_api/; default 8080, 0: off); same TLS and keys
#   RENDER_ONLY=1     render into $RENDER_DIR and exit (inspect the configuration)
# Extra arguments go to tritonserver.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
repo="${RENDER_DIR:-/tmp/model_repository}"
envs=()
if [[ -n "${GRAMMAR_PYTHON_ENV:-}" ]]; then
    for model in grammar preprocessing postprocessing; do
        envs+=(--execution-env "${model}=${GRAMMAR_PYTHON_ENV}")
    done
fi
python3 -m deploy.render --src model_repository --dst "$repo" --values deploy/values.json \
    --set "MODEL_DIR=${MODEL_DIR}" --set "ENGINE=${ENGINE}" --set "DEVICE=${DEVICE}" \
    --set "MAX_BATCH=${MAX_BATCH}" --set "GRAMMAR_MODE=${GRAMMAR_MODE}" \
    --set "STREAM_INTERVAL_MS=${STREAM_INTERVAL_MS:-50}" --set "MAX_PREFILL_TOKENS=${MAX_PREFILL_TOKENS:-}" \
    --set "PROMPT_FORMAT=${PROMPT_FORMAT:-chat}" --set "TRTLLM_SAMPLER=${TRTLLM_SAMPLER:-}" \
    --set "TRTLLM_SPECULATIVE_CONFIG=${TRTLLM_SPECULATIVE_CONFIG:-}" \
    --set "GRAMMAR_STORE_DIR=${GRAMMAR_STORE_DIR:-/var/lib/constrained-llm/grammar-store}" \
    --set "GRAMMAR_STORE_MAX_BYTES=${GRAMMAR_STORE_MAX_BYTES:-}" --set "GRAMMAR_FILL_THREADS=${GRAMMAR_FILL_THREADS:-0}" \
    --set "REASONING_START=${REASONING_START:-}" --set "REASONING_END=${REASONING_END:-}" "${envs[@]}"
if [[ "${RENDER_ONLY:-0}" == 1 ]]; then
    exit 0
fi
stub_env="$(python3 -c 'import sys; print(sys.prefix)')"
exec "${LAUNCHER_PYTHON:-python3}" -m deploy --model-repository "$repo" --host 0.0.0.0 --python-env "$stub_env" \
    --grpc-port 8001 --http-port 8000 --metrics-port 8002 --health-port 8003 --openai-port "${OPENAI_PORT:-8080}" \
    --model constrained_llm \
    --ready-timeout "${READY_TIMEOUT_S:-1800}" -- "$@"
