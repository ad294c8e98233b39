#!/usr/bin/env bash
# Render the model repository for this container's settings, then run the
# supervised server (gateway on 0.0.0.0:8001, Triton's HTTP 8000 and metrics
# 8002, probe endpoints 8003: deploy/health.py).  Settings come from the environment (defaults in deploy/docker/Dockerfile
# for the GPU image, deploy/docker/Dockerfile.cpu for the CPU one):
#   ENGINE, DEVICE    torch + cpu (CPU image) or tensorrt_llm + cuda (GPU image)
#   MODEL_DIR         Hugging Face checkpoint folder (tokenizer; the model for torch and trtllm_backend pytorch)
#   TRTLLM_ENGINE_DIR built TensorRT engine folder (trtllm_backend tensorrt only)
#   TRTLLM_BACKEND    pytorch | tensorrt
#   GRAMMAR_MODE      processor | native
#   MAX_BATCH         decode batch
#   STREAM_INTERVAL_MS  least milliseconds between a stream's responses after the first (default 50; 0: every token)
#   RENDER_ONLY=1     render into $RENDER_DIR and exit (inspect the configuration)
# Extra arguments go to tritonserver.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
repo="${RENDER_DIR:-/tmp/model_repository}"
python3 -m deploy.render --src model_repository --dst "$repo" --values deploy/values.json \
    --set "MODEL_DIR=${MODEL_DIR}" --set "ENGINE=${ENGINE}" --set "DEVICE=${DEVICE}" \
    --set "MAX_BATCH=${MAX_BATCH}" --set "GRAMMAR_MODE=${GRAMMAR_MODE}" \
    --set "STREAM_INTERVAL_MS=${STREAM_INTERVAL_MS:-50}" \
    --set "TRTLLM_BACKEND=${TRTLLM_BACKEND}" --set "TRTLLM_ENGINE_DIR=${TRTLLM_ENGINE_DIR:-}" \
    --set "GRAMMAR_STORE_DIR=${GRAMMAR_STORE_DIR:-/var/lib/constrained-llm/grammar-store}"
if [[ "${RENDER_ONLY:-0}" == 1 ]]; then
    exit 0
fi
exec python3 -m deploy.server --model-repository "$repo" --host 0.0.0.0 \
    --grpc-port 8001 --http-port 8000 --metrics-port 8002 --health-port 8003 --model constrained_llm \
    --ready-timeout "${READY_TIMEOUT_S:-1800}" -- "$@"
