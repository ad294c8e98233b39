#!/usr/bin/env bash
# Pre-flight for the first GPU host: one command, a table of checks, tokens/s constrained vs not.
#
#   deploy/gpu/preflight.sh IMAGE MODEL_DIR [SPECULATIVE_CONFIG]
#       e.g. constrained-llm:gpu /models/qwen2.5-1.5b-instruct
#
# SPECULATIVE_CONFIG (TRTLLM_SPECULATIVE_CONFIG's JSON; default an NGram config, which needs no
# draft model; "-" skips it): after the plain checks, the server starts again with it, and the
# same greedy constrained requests run through TensorRT-LLM's speculative decoding and the
# grammar decoder's draft rows.  The outputs must be valid; the texts are compared with the
# run without speculation (a difference is reported, not fatal: a multi-token forward's
# numerics may break a near tie, but a difference on every prompt points at the draft rows).
#
# NEVER RUN where this project is built (no GPU, no docker daemon): written against the
# image of deploy/docker/Dockerfile.  It stops at the first failed check, so the table
# says how far the host got.  Budget: model load (minutes) + 8 requests; under 10 minutes
# for a 1-2B checkpoint.
set -euo pipefail
image="${1:?usage: preflight.sh IMAGE MODEL_DIR}"
model="${2:?usage: preflight.sh IMAGE MODEL_DIR}"
speculative="${3-{\"decoding_type\": \"NGram\", \"max_draft_len\": 4, \"max_matching_ngram_size\": 2\}}"
name="constrained-llm-preflight-$$"
rows=()
row() { rows+=("$(printf '| %-44s | %-4s | %s |' "$1" "$2" "$3")"); }
report() {
    printf '| %-44s | %-4s | %s |\n|%s|%s|%s|\n' check ok detail "$(printf -- '-%.0s' {1..46})" "------" "---------"
    printf '%s\n' "${rows[@]}"
}
fail() { row "$1" FAIL "$2"; report; docker rm -f "$name" >/dev/null 2>&1 || true; exit 1; }
trap 'docker rm -f "$name" >/dev/null 2>&1 || true' EXIT

# 1. Driver: CUDA 13.1 (NGC 26.07) needs R580 or newer without the forward-compatibility package.
driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)" || fail "driver (nvidia-smi)" "no driver"
(( ${driver%%.*} >= 580 )) || fail "driver >= 580" "$driver"
row "driver >= 580" ok "$driver"

in_image() { docker run --rm --gpus all --entrypoint bash "$image" -c "$1"; }
# 2. The two environments, as the build checked them, now with a GPU.
out="$(in_image 'python3 -m deploy.image_check llm requirements-gpu-llm.txt --before llm-env.before.json')" || fail "llm env (image_check llm)" "$out"
row "llm env: the additions broke nothing" ok "${out:0:60}"
out="$(in_image '/opt/grammar-env/bin/python3 -m deploy.image_check grammar requirements-gpu-grammar.txt')" \
    || fail "grammar env (image_check grammar)" "$out"
row "grammar env: project pins" ok "${out:0:60}"
out="$(in_image 'python3 -c "import torch, tensorrt_llm; assert torch.cuda.is_available(); print(tensorrt_llm.__version__, torch.cuda.get_device_name(0))"' 2>&1 | tail -1)" \
    || fail "import tensorrt_llm + CUDA" "$out"
row "import tensorrt_llm + CUDA" ok "$out"

# 3. The served ensemble: the PyTorch backend loads the checkpoint, the grammar decoder is installed.
serve() {  # serve [docker run options...]: start the server, wait until it is ready (10 min)
    docker run -d --name "$name" --gpus all --shm-size=2g -p 127.0.0.1:18001:8001 -p 127.0.0.1:18003:8003 \
        -v "$model":/models/hf:ro "$@" "$image" >/dev/null
    for _ in $(seq 1 120); do
        curl -fs http://127.0.0.1:18003/v2/health/ready >/dev/null 2>&1 && return 0
        docker inspect -f '{{.State.Running}}' "$name" | grep -q true || fail "server starts" "$(docker logs --tail 20 "$name" 2>&1)"
        sleep 5
    done
    fail "server ready within 10 min" "$(docker logs --tail 20 "$name" 2>&1)"
}
serve
row "server ready (PyTorch backend, grammar decoder)" ok "model $model"
docker logs "$name" 2>&1 | grep -q "Using Python execution env /opt/grammar-env" \
    || fail "grammar models in /opt/grammar-env" "no 'Using Python execution env' line in the log"
row "grammar models in their own env" ok "EXECUTION_ENV_PATH /opt/grammar-env"

# 4. A constrained request is valid; tokens/s constrained vs unconstrained (4 requests each, in turn).
schema='{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"],"additionalProperties":false}'
client() { docker exec "$name" /opt/grammar-env/bin/python3 -m client --url 127.0.0.1:8001 --print-result "$@"; }
result="$(client --schema "$schema" --max-tokens 128 "A person as JSON." | tail -1)" || fail "constrained request" "$result"
echo "$result" | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["json"]["valid"], r' \
    || fail "constrained output valid" "$result"
row "constrained output parses and validates" ok "${result:0:60}"
rate() {
    local start end tokens=0 n
    start=$(date +%s.%N)
    for _ in 1 2 3 4; do
        n="$(client "$@" --max-tokens 256 --temperature 0 "Describe a person." | tail -1 \
            | python3 -c 'import json,sys; print(json.load(sys.stdin)["usage"]["completion_tokens"])')"
        tokens=$((tokens + n))
    done
    end=$(date +%s.%N)
    python3 -c "print(f'{$tokens / ($end - $start):.1f} tok/s ({$tokens} tokens)')"
}
row "tokens/s unconstrained (c1, 4 requests)" ok "$(rate)"
row "tokens/s constrained (c1, 4 requests)" ok "$(rate --schema "$schema")"

# 5. TensorRT-LLM's speculative decoding through the grammar decoder's draft rows.
prompts=("A person as JSON." "Copy this record as JSON: name Ada Lovelace, age 36." "A person named Bob, as JSON.")
texts() { for p in "${prompts[@]}"; do client --schema "$schema" --max-tokens 128 --temperature 0 "$p" | tail -1; done; }
if [[ "$speculative" != "-" ]]; then
    plain="$(texts)" || fail "greedy constrained requests" "$plain"
    docker rm -f "$name" >/dev/null
    serve -e "TRTLLM_SPECULATIVE_CONFIG=$speculative"
    # The engine's log line is INFO, below the stub's default level: the rendered parameter is what shows the
    # setting reached the llm model (a value it refuses keeps the server from becoming ready above).
    docker exec "$name" grep -q decoding_type /tmp/model_repository/llm/config.pbtxt \
        || fail "speculative decoding on" "no decoding_type in the rendered llm config"
    row "server ready with speculative decoding" ok "${speculative:0:60}"
    drafted="$(texts)" || fail "constrained requests, speculative" "$drafted"
    echo "$drafted" | python3 -c 'import json,sys; rs=[json.loads(l) for l in sys.stdin]; assert all(r["json"]["valid"] for r in rs), rs' \
        || fail "speculative outputs valid" "$drafted"
    row "speculative outputs parse and validate" ok "${#prompts[@]} prompts"
    same="$(python3 -c 'import json,sys; a,b=(sys.argv[1].splitlines(), sys.argv[2].splitlines()); print(sum(json.loads(x)["text"] == json.loads(y)["text"] for x, y in zip(a, b)))' "$plain" "$drafted")"
    row "greedy texts equal to no speculation" "$([[ $same == "${#prompts[@]}" ]] && echo ok || echo DIFF)" "$same of ${#prompts[@]}"
    row "tokens/s constrained, speculative (c1)" ok "$(rate --schema "$schema")"
fi
report
