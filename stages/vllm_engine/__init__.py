"""vLLM as mmpipe's engine for the roles that prefill and decode together
(``encode+prefill+decode`` and ``prefill+decode``), chosen with
``--engine vllm``.

Nothing here imports vLLM (or torch) at package import: ``stage`` and
``engine`` do, and only ``pipeline.serve.build_stage`` imports them, when a
worker is started with ``--engine vllm``. ``cpu_compat`` is the shim the
CPU venv of ``deploy/install-vllm.sh`` loads in every process.
"""

from __future__ import annotations

from stages.vllm_engine.args import VLLM_ROLES, VllmUnavailable, engine_args, require_vllm

__all__ = ["VLLM_ROLES", "VllmUnavailable", "engine_args", "require_vllm"]
