#!/usr/bin/env bash
# The SGLang engine's tests (tests/sglang) in the SGLang venv that
# deploy/install-sglang.sh builds (run that first), with the environment
# SGLang wants on a CPU host: its CPU engine, no inductor compile of the
# vision rotary, no hub, its temp files in a scratch folder removed after.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-sglang}
[ -x "$VENV/bin/python" ] || { echo "no $VENV: run bash deploy/install-sglang.sh first" >&2; exit 1; }
scratch=$(mktemp -d "${TMPDIR:-/tmp}/mmpipe-sglang.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
export SGLANG_USE_CPU_ENGINE=1 TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 TMPDIR="$scratch"
export PATH="$PWD/$VENV/bin:$PATH"
"$VENV/bin/python" -c "import sglang" >/dev/null
paths=tests/sglang
for arg in "$@"; do [[ $arg == tests/* ]] && paths=; done
"$VENV/bin/python" -m pytest $paths -p no:cacheprovider "$@"
