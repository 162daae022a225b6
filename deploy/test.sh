#!/usr/bin/env bash
# The whole test suite, as CI runs it: install, lint, type-check, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh --test
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
ruff format --check pipeline stages schemas tests
ruff check pipeline stages schemas tests
mypy
exec python -m pytest "$@"
