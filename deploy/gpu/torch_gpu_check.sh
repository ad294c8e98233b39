#!/usr/bin/env bash
# The embedded torch engine and the grammar engine on a CUDA GPU, in one process (no Triton).
#
#   deploy/gpu/torch_gpu_check.sh OUT_DIR SMOLLM2_DIR QWEN3_TOKENIZER_DIR [SHAPE ...]
#
# SMOLLM2_DIR: a folder with SmolLM2's config.json and tokenizer files (its
# weights are not read). QWEN3_TOKENIZER_DIR: Qwen3's tokenizer.json. SHAPEs:
# bench/random_checkpoint.py's (default: qwen3-1.7b; qwen3-8b takes 16 GB of
# disk and a minute to write).
#
# For each model shape, a checkpoint with random weights (bench/random_checkpoint.py:
# a forward costs what the shape costs, whatever the weights; the outputs are
# noise) runs bench/processor_bench.py on cuda in bfloat16 at batch 1, 16 and 64:
# ms per decode step unconstrained, with the grammar step overlapped on a worker
# thread, and in a logits processor's order; tokens/s; and how many constrained
# outputs (closed at the budget) parse and match the schema, which must be all.
# Then the grammar step's fill at 256 rows on 1 and the default fill threads (CPU only).
# Writes OUT_DIR/<model>-<backend>.json, OUT_DIR/fill-states.json and OUT_DIR/log.txt.
#
# What it does not cover: the served path (tritonserver and the Python-backend
# stubs) and TensorRT-LLM; deploy/gpu/preflight.sh does, inside the GPU image.
set -euo pipefail

out=${1:?OUT_DIR}
smol=${2:?SMOLLM2_DIR}
qwen=${3:?QWEN3_TOKENIZER_DIR}
shift 3
shapes=("$@")
[[ ${#shapes[@]} -gt 0 ]] || shapes=(qwen3-1.7b)
py=${PYTHON:-python3}
work=${WORK_DIR:-/tmp/torch-gpu-check}
mkdir -p "$out" "$work"
exec > >(tee -a "$out/log.txt") 2>&1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$py" -c 'import torch; from importlib.metadata import version as v; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "| xgrammar", v("xgrammar"), "| llguidance", v("llguidance"), "| transformers", v("transformers"))'
echo "CPU cores: $(nproc)"
# The last step's bench imports the serving stack too (tritonclient, psutil, aiohttp...: requirements.txt
# besides torch), which the GPU benches above do not need: checked now, so a host without it learns before
# the GPU runs, and the step is skipped with the reason rather than failing the script at its end.
if fill_error=$("$py" -c 'import sys; sys.path.insert(0, "bench"); import grammar_step_bench' 2>&1); then
    fill_bench=1
else
    fill_bench=0
    echo "the grammar fill step will be skipped: bench/grammar_step_bench.py does not import (${fill_error##*$'\n'});" \
         "install requirements.txt's packages besides torch to run it"
fi

bench() {  # model_dir name backend batches...
    local dir=$1 name=$2 backend=$3
    shift 3
    echo "== $name, $backend"
    "$py" bench/processor_bench.py "$dir" --device cuda --dtype bfloat16 --backend "$backend" \
        --batch "$@" --tokens 64 --rounds 2 --json "$out/$name-$backend.json" 2>&1 | grep -v "Loading weights"
}

"$py" bench/random_checkpoint.py "$smol/config.json" "$smol" "$work/smollm2-135m" --device cuda >/dev/null
bench "$work/smollm2-135m" smollm2-135m xgrammar 1 16 64
bench "$work/smollm2-135m" smollm2-135m llguidance 1 16 64
for shape in "${shapes[@]}"; do
    "$py" bench/random_checkpoint.py "$shape" "$qwen" "$work/$shape" --device cuda >/dev/null
    bench "$work/$shape" "$shape" xgrammar 1 16 64
    bench "$work/$shape" "$shape" llguidance 16 64
    rm -rf "${work:?}/$shape"
done
# The grammar step's fill on this node's CPUs (no GPU): 256 rows held in cheap and costly states, and the
# engine's step along the paths, on 1 and the grammar model's default fill threads (half the CPUs, up to 8).
# xgrammar's rows take those threads only where their last fill took XGRAMMAR_SPREAD_MIN_S
# (grammar_backend/bitmask.py), a crossover measured on 2 threads of a 2-CPU host only.
if [[ $fill_bench == 1 ]]; then
    threads=$("$py" -c 'from grammar_service.cpus import auto_fill_threads, usable_cpus; print(auto_fill_threads(usable_cpus()))')
    [[ -e build/tokenizers/qwen3 ]] || { mkdir -p build/tokenizers && ln -s "$(cd "$qwen" && pwd)" build/tokenizers/qwen3; }
    echo "== grammar fill, 256 rows, 1 and $threads fill threads"
    "$py" bench/grammar_step_bench.py --fill-states --threads "$threads" --rows 256 --json "$out/fill-states.json"
else
    echo "== grammar fill: skipped (${fill_error##*$'\n'})"
fi
echo "torch_gpu_check: done"
