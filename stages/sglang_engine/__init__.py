"""SGLang as an engine behind the hop-engine contract (``--engine sglang``).

``engine.SglangEngine`` runs SGLang's offline ``Engine`` inside the worker
process (its scheduler and detokenizer in child processes);
``hop_engine.SglangHopEngine`` serves the hop roles that prefill and decode
on it. Only imported where SGLang is installed (``.venv-sglang``,
deploy/install-sglang.sh, or ``pip install 'mmpipe[sglang]'`` on a GPU host).
"""

# The roles SGLang runs: those that prefill and decode in one worker.
SGLANG_ROLES = ("encode+prefill+decode", "prefill+decode")
