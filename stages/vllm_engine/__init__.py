"""vLLM as mmpipe's engine (``--engine vllm``): ``VllmHopEngine``
(``hop_engine``) behind the one ``HopStage``, built by ``stage`` (the roles
that prefill and/or decode) and ``encoder_only`` (``encode``).

Nothing here imports vLLM (or torch) at package import: those modules do
(torch at import, vLLM once the engine starts), and only
``pipeline.serve.build_stage`` imports them, when a worker is started with
``--engine vllm``. ``cpu_compat`` is the shim the
CPU venv of ``deploy/install-vllm.sh`` loads in every process.
"""

from __future__ import annotations

from stages.vllm_engine.args import VLLM_ROLES, VllmUnavailable, require_vllm

__all__ = ["VLLM_ROLES", "VllmUnavailable", "require_vllm"]
