#!/usr/bin/env bash
# Installs a separate virtualenv (.venv-sglang) for mmpipe's SGLang engine on
# a CPU host: SGLang 0.5.23 with the torch, torchvision and transformers it
# pins, plus mmpipe itself and what its workers, the bridge, nats-server and
# tests/sglang need. The main .venv stays without SGLang. On a GPU host:
# `pip install -e '.[sglang]'` from this repository (SGLang's own CUDA
# kernels come with it there).
#
# What SGLang needs on a CPU host (checked with 0.5.23):
# - Its kernel packages (sglang-kernel, flashinfer, flash-attn-4, the
#   cutlass DSL, tilelang, deep-ep/gemm, flash-mla, cuda-python, ...) are
#   CUDA-only wheels: left out, every other requirement installed, then
#   SGLang itself without its dependency list.
# - torch 2.14.1 and torchvision 0.29.1 as the index has them (CUDA builds;
#   they run on the CPU, and SGLang imports torchvision): the CPU torch of
#   the main venv pairs with no torchvision here. torchaudio and torchcodec
#   (pinned to other torch releases) are left out.
# - A few `sgl_kernel` ops its CPU paths call: plain-torch stand-ins
#   (stages/sglang_engine/cpu_shim/sgl_kernel), on the venv's path through a
#   .pth file, and a patch that lets SGLang's NIXL transfer engine register
#   the KV pool as host memory (prefill and decode apart on a CPU). A test
#   shim for this CPU venv, never installed on a GPU host.
# deploy/test-sglang.sh runs tests/sglang there with the environment SGLang
# wants on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-sglang}
PYTHON=${PYTHON:-python3}
SGLANG_SPEC=${SGLANG_SPEC:-sglang==0.5.23}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip_quiet() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
pip_quiet install --upgrade pip packaging
pip_quiet install "${TORCH_SPEC:-torch==2.14.1}" "${TORCHVISION_SPEC:-torchvision==0.29.1}"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
pip_quiet download --no-deps -d "$scratch" "$SGLANG_SPEC"
mapfile -t deps < <("$VENV/bin/python" - "$scratch" <<'PY'
import sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement

# CUDA-only wheels (or built against another torch): not on a CPU host.
cuda_only = {
    "apache-tvm-ffi", "cuda-python", "flash-attn-4", "flashinfer-python", "humming-kernels",
    "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels", "sgl-deep-ep",
    "sgl-deep-gemm", "sgl-flash-mla", "sglang-kernel", "tilelang", "torch-memory-saver",
    "torchaudio", "torchcodec", "deepseek-recipe", "tml-renderers", "smg-grpc-servicer",
}
installed = {"torch", "torchvision"}
[wheel] = Path(sys.argv[1]).glob("sglang-*.whl")
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    name = req.name.lower().replace("_", "-")
    if name in cuda_only or name in installed or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
PY
)
pip_quiet install "${deps[@]}"
pip_quiet install --no-deps "$scratch"/sglang-*.whl
# mmpipe without its dependency list (torch and transformers stay SGLang's),
# then its other dependencies and the test tools by name.
source deploy/one-editable-install.sh
one_editable_install pip_quiet install --no-deps -e .
mapfile -t own < <("$VENV/bin/python" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = {"torch", "transformers", "nixl-cu13"}
deps = [d for d in project["dependencies"] if re.split(r"[<>=!~; \[]", d, maxsplit=1)[0] not in skip]
wanted = {"pytest", "pytest-asyncio", "pytest-timeout", "openai", "psutil"}
deps += [d for d in project["optional-dependencies"]["test"] if re.split(r"[<>=!~; \[]", d, maxsplit=1)[0] in wanted]
print("\n".join(deps))
PY
)
pip_quiet install "${own[@]}"
# The tensor transport's NIXL (E/PD hands embeddings over): without its
# dependencies, which would pull another torch.
pip_quiet install --no-deps "${NIXL_CU13_SPEC:-nixl-cu13==1.5.1}" "${NIXL_SPEC:-nixl==1.5.1}"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# The shim's folder on the path, and its patches for SGLang's PD
# disaggregation on a CPU (an import line of a .pth runs at every start,
# so SGLang's spawned scheduler processes get them too).
printf '%s\nimport mmpipe_sglang_cpu_patches\n' "$PWD/stages/sglang_engine/cpu_shim" > "$site/mmpipe_sglang_cpu_shim.pth"
"$VENV/bin/python" -c "import sglang, transformers, torch; print('sglang', sglang.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
