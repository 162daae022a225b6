"""SGLang as an engine behind the hop-engine contract (``--engine sglang``).

``engine.SglangEngine`` runs SGLang's offline ``Engine`` inside the worker
process (its scheduler and detokenizer in child processes);
``hop_engine.SglangHopEngine`` serves the hop roles that prefill and decode
on it. Only imported where SGLang is installed (``.venv-sglang``,
deploy/install-sglang.sh, or ``pip install 'mmpipe[sglang]'`` on a GPU host).
"""

# The roles SGLang runs: every role that prefills or decodes. Prefill and
# decode apart (E/P/D, EP/D) move the KV cache by SGLang's own PD
# disaggregation.
SGLANG_ROLES = ("encode+prefill+decode", "prefill+decode", "encode+prefill", "prefill", "decode")


def disaggregation_of(role: str) -> str | None:
    """SGLang's ``disaggregation_mode`` for a role: ``prefill`` where the role
    ends at prefill, ``decode`` where it starts at decode, None where one
    engine does both."""
    steps = role.split("+")
    if "prefill" in steps and "decode" not in steps:
        return "prefill"
    if "decode" in steps and "prefill" not in steps:
        return "decode"
    return None
