#!/usr/bin/env bash
# Installs mmpipe (and, with --test, what the tests need) into a virtualenv.
# torch comes first: a bare `torch` requirement on a host without it pulls a
# CUDA build of several GB. CPU hosts get TORCH_SPEC (default: the CPU build
# torch==2.13.0); a host that already has torch in the venv keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${pip[@]}" install "${TORCH_SPEC:-torch==2.13.0}"
fi
source deploy/one-editable-install.sh
one_editable_install "${pip[@]}" install -e ".$extra"
echo "mmpipe installed in $VENV"
