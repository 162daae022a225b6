#!/usr/bin/env bash
# The engine equality tests on a GPU (issue 6, goal 5): the tiny models built
# from config, the engine and the transformers reference generate() both on
# CUDA in float32 with TF32 off (tests/conftest.py, --engine-device), the
# batch decoder replaying CUDA graphs, its fused step compiled. CI runs the
# same files on the CPU (the default device).
#
# No install, no venv: mmpipe from this checkout on PYTHONPATH, and torch,
# transformers, pytest, pytest-asyncio, pytest-timeout and mmpipe's runtime
# packages importable by $PYTHON. Arguments go to pytest (-x, -k fused, ...);
# MMPIPE_TEST_DEVICE=cuda:1 picks another card. The first test of each engine
# also compiles the fused step and captures graphs: a longer timeout than CI's.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
exec "${PYTHON:-python3}" -m pytest -p no:cacheprovider -v --timeout 900 \
  --engine-device "${MMPIPE_TEST_DEVICE:-cuda}" \
  tests/stages/test_engine_qwen2_vl.py \
  tests/stages/test_batch_decode.py \
  tests/stages/test_families.py \
  tests/stages/test_families_av.py \
  tests/stages/test_embeds.py \
  tests/stages/test_vision_attention.py \
  tests/stages/test_fused_decode.py \
  tests/stages/test_triton_linear.py \
  tests/stages/test_slot_prefill.py \
  tests/stages/test_chunked_prefill.py \
  tests/stages/test_lora.py \
  tests/stages/test_tower_graphs.py \
  tests/stages/test_device_copy.py \
  tests/pipeline/test_transport.py \
  "$@"
