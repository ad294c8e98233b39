#!/usr/bin/env bash
# The GPU tests (tests/gpu) inside the GPU image, as its user (uid 10001): `make test-gpu` runs this.
#
#   docker run --rm --gpus all --shm-size=2g -v "$PWD":/src:ro -w /src -v "$HF":/models/hf:ro \
#       --entrypoint deploy/gpu/test_gpu.sh constrained-llm:gpu
#
# The tests run in the grammar environment (where the launcher, the gateway and the client run), with
# pytest in a venv under /tmp that sees the grammar environment's packages (a .pth file): the image's
# environments are root's and stay as built; the user can write /tmp only. (`--system-site-packages`
# would not do: it layers over the base interpreter, not over a venv.) TensorRT-LLM's interpreter is
# TRTLLM_PYTHON: the marker `trtllm` looks for the package there, and the llm model's stub runs in its
# environment.
#   GRAMMAR_PYTHON    the grammar environment's python (default $GRAMMAR_PYTHON_ENV/bin/python3)
#   TRTLLM_PYTHON     TensorRT-LLM's (default: python3 on PATH, the image's /opt/venv-tritonserver)
#   TRTLLM_TEST_MODEL the checkpoint (default /models/hf)
#   TEST_ENV          where the test venv goes (default /tmp/gpu-test-env)
# Extra arguments go to pytest. NEVER RUN where this project is built (no GPU); its venv and collection
# steps run as uid 10001 in `make test` (tests/unit/test_deploy_images.py -k test_gpu).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
grammar_python="${GRAMMAR_PYTHON:-${GRAMMAR_PYTHON_ENV:-/opt/grammar-env}/bin/python3}"
env_dir="${TEST_ENV:-/tmp/gpu-test-env}"
export TRTLLM_PYTHON="${TRTLLM_PYTHON:-$(command -v python3)}"
export TRTLLM_TEST_MODEL="${TRTLLM_TEST_MODEL:-/models/hf}"
export REQUIRE_ASSETS="${REQUIRE_ASSETS:-1}"
export HOME="${HOME:-/tmp}"
if [[ ! -x "$env_dir/bin/python" ]]; then
    "$grammar_python" -m venv "$env_dir"
    own_site="$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$grammar_python" -c 'import site, sys; print("".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages()))' \
        > "$own_site/grammar-env.pth"
fi
# pytest at the project's pin (requirements-dev.txt), unless the grammar environment has it.
if ! "$env_dir/bin/python" -c 'import pytest' 2>/dev/null; then
    "$env_dir/bin/python" -m pip install --no-cache-dir "$(grep -E '^pytest==' requirements-dev.txt)"
fi
# -p no:cacheprovider: the checkout may be mounted read-only.
exec "$env_dir/bin/python" -m pytest -p no:cacheprovider tests/gpu -q -rs "$@"
