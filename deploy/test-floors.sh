#!/usr/bin/env bash
# The dependency floors, tested: a fresh venv gets exactly the lowest version
# pyproject.toml allows of every dependency and test requirement (each `>=X`
# installed as `==X`), then a smoke subset of the tests runs against them:
# settings and the CLI, NATS streams, the engine's hops over NATS and NIXL,
# and one real `mmpipe up` answering the openai client.
#
# torch is not floored here: the only torch reachable offline on a CPU host is
# the CPU build TORCH_SPEC (default torch==2.13.0, as deploy/install.sh). The
# project's floor (torch>=2.11) is what the GPU machines run.
#
# `--install` only builds the venv, `--test` only runs the smoke subset in the
# venv an earlier `--install` built; neither (what .ci/run does): both.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-floors}
PYTHON=${PYTHON:-python3}
step=${1:-all}
case $step in
  all | --install | --test) ;;
  *) echo "usage: $0 [--install | --test]" >&2; exit 2 ;;
esac
py="$VENV/bin/python"
if [[ $step != --test ]]; then
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
pip=("$py" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install "${TORCH_SPEC:-torch==2.13.0}"

# `name>=X[,...][; marker]` -> `name==X[; marker]`, for [project].dependencies
# and the test extra; the names (for the freeze below) go to names.txt.
floors="$VENV/floors.txt"
"$py" - "$floors" "$VENV/names.txt" <<'EOF'
import re
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["test"]
pins, names = [], []
for req in reqs:
    spec, _, marker = req.partition(";")
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*", spec)
    if not m:
        sys.exit(f"test-floors: cannot parse requirement {req!r}")
    name, specifiers = m.group(1), m.group(3)
    names.append(name)
    low = re.search(r">=\s*([^,\s]+)", specifiers)
    if name.lower() == "torch" or not low:
        continue
    pins.append(f"{name}=={low.group(1)}" + (f"; {marker.strip()}" if marker.strip() else ""))
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
open(sys.argv[2], "w").write("\n".join(names) + "\n")
EOF
echo "--- floors ($floors)"
cat "$floors"
source deploy/one-editable-install.sh
one_editable_install "${pip[@]}" install -c "$floors" -e ".[test]"

echo "--- installed"
names=$(sed 's/[-_.]/[-_.]/g' "$VENV/names.txt" | paste -sd '|')
"$py" -m pip --disable-pip-version-check freeze | grep -iE "^($names)==" || true

echo "--- installed in ${SECONDS}s"
fi
[[ $step == --install ]] && exit 0
[ -x "$py" ] || { echo "no $VENV: run $0 --install first" >&2; exit 1; }
echo "--- smoke tests"
# Left out: test_up's other modes and setting sources (one of each runs) and the
# documents' checks (no dependency in them; the full suite runs them).
"$py" -m pytest -q -p no:cacheprovider --timeout 600 \
  tests/pipeline/test_settings.py tests/pipeline/test_streams.py \
  tests/stages/test_hop_engine.py tests/e2e/test_up.py tests/e2e/test_structured_output.py \
  -k "(not every_mode or epd-0) and (not each_source or config) and not (documents_name or settings_reference) \
and (not random_weights)"
