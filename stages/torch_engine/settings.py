"""Engine settings a process sets before any model loads: plain data, no
torch import (the bridge and the CLI read them)."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.settings import setting


@dataclass(frozen=True)
class DecodeSettings:
    """The batch decoder: every running sequence in one forward over a
    paged KV cache, blocks of ``block_size`` tokens from one pool (CUDA
    graphs on a GPU). Off, or for a sequence that does not fit, each
    sequence runs the model on its own cache."""

    batched: bool = setting(
        True, flag="batch-decode", help="decode every running sequence in one step (off: each on its own)"
    )
    # The worker's --max-num-seqs: the batch decoder's rows.
    slots: int = 32
    # The role decodes. A role that ends at prefill keeps the decoder only
    # where prefill goes straight into its slots (the fused step, on a GPU),
    # and captures no decode step.
    decodes: bool = True
    # The role runs the vision tower: on a GPU its blocks are compiled at start
    # (a split mode's prefill or decode worker takes embeddings, never images).
    encodes: bool = True
    max_len: int = setting(4096, flag="decode-max-len", help="tokens one sequence may hold in the batch decoder")
    block_size: int = setting(16, help="tokens per block of the paged KV cache (a power of two)")
    kv_cache_memory: str | None = setting(
        None,
        help="memory for the KV cache's blocks: a fraction of the device memory free once the weights are loaded "
        "(0.5; on CPU of the host's free memory), or bytes (8GiB, 512MiB, 1000000); one sequence of "
        "--decode-max-len tokens at least. Unset: room for 32 sequences of --decode-max-len tokens (--max-num-seqs "
        "if fewer)",
    )
    prefix_caching: bool = setting(
        True,
        flag="enable-prefix-caching",
        help="keep the KV blocks of prompts' full blocks in the pool after their sequences end, keyed by their "
        "tokens, the media bytes they show and every block before them; a later prompt that starts the same "
        "reuses them and prefills only the rest (freed cached blocks are taken for new ones least recently used "
        "first, only when no other block is free)",
    )
    cuda_graphs: bool = setting(True, help="capture decode steps as CUDA graphs (off: run them eagerly)")
    torch_compile: bool = setting(
        True,
        help="on a GPU, compile the engine's layer pieces with torch.compile (the decode step's, the prefill "
        "graphs' and the Qwen2-VL vision tower's blocks), their elementwise work fused; off: the modules' kernels, "
        "CUDA graphs still captured. The CPU never compiles",
    )
    # None: on CUDA only (the CPU keeps generate()'s exact numerics).
    fused: bool | None = setting(
        None,
        flag="fused-decode",
        help="the fused layer step (one kernel set per layer) instead of the model's modules (unset: on CUDA only)",
    )
    # 0: every prompt through the model's modules.
    graph_prefill_len: int = setting(
        2048,
        flag="graph-prefill-len",
        help="where the fused step runs, prompts of up to this many tokens prefill straight into a decoder slot, "
        "one CUDA graph per length bucket (0: the model's modules for every prompt)",
    )
    # vLLM's name; its default for an API server.
    max_num_batched_tokens: int = setting(
        2048,
        help="a prompt longer than this (media expanded) is prefilled in chunks of this many tokens, each with a "
        "running decode step (in its forward on the fused layers without CUDA graphs; with them right after it, "
        "the chunk's own graph) or alone when none runs (0: every prompt in one call)",
    )
    # vLLM's names. 0: the stacks sized to the adapters loaded (remade, and graphs captured again, at each load).
    max_loras: int = setting(
        0,
        help="LoRA adapters loaded at once, their room in the fused step's stacks reserved at start (vLLM's "
        "--max-loras): a load or unload writes the stacks in place, no graph captured or compiled again, each step "
        "a rank's matrix products more; 0: no limit, the stacks remade and the graphs captured again on first "
        "use after a load",
    )
    max_lora_rank: int = setting(
        16, help="with --max-loras: the highest rank of an adapter's module that a load takes (vLLM's)"
    )
    step_priority_ms: float | None = setting(
        None,
        help="engine-thread time the calls that admit requests (encodes, prefills) get before a waiting decode "
        "step goes ahead of them (0: steps first; negative: every call in submission order; unset: 0 on a GPU, "
        "submission order on a CPU). Lower: smoother tokens under load; higher: requests admitted faster",
    )
    calls_ahead_of_step: int = setting(
        0,
        help="on a GPU, while sequences decode: how many encodes and prefills may have work queued on the device "
        "ahead of the next decode step (the engine thread launches another once the earlier ones are done there; "
        "0: no bound). 1: shorter, emptier steps and smoother tokens, fewer requests admitted (2B preset, H200, 64 "
        "clients: ITL p99 38.8 against 44.5 ms, 46.2 against 58.3 req/s)",
    )
    gpu_call_spans: bool = setting(
        False,
        help="on a GPU, time each engine call's work on the device with CUDA events "
        "(mmpipe_engine_call_gpu_seconds_total; bench --engine-metrics shows it): off by default, as a run with it "
        "on served fewer requests (unmeasured alone)",
    )
    tower_graphs: int = setting(
        8,
        help="on a GPU, image grids whose vision tower call is kept as a CUDA graph, captured the second time a "
        "grid comes (Qwen2-VL; 0: the tower runs eagerly)",
    )


def step_priority_s(step_priority_ms: float | None, device: str) -> float | None:
    """``--step-priority-ms`` as the engine thread takes it (seconds; None:
    submission order). Unset: steps first on a GPU, where a step is a graph
    launch and new requests lose little (2B preset, H100, 64 clients: ITL p99
    172 against 54 ms, 36.7 against 34.3 req/s); submission order on a CPU,
    where the engine thread is the compute and steps first let new requests
    in one call per step (2 vCPUs, 32 clients: 14-17 against 21 req/s)."""
    if step_priority_ms is None:
        return 0.0 if device.startswith("cuda") else None
    return None if step_priority_ms < 0 else step_priority_ms / 1000


def intra_op_threads(torch_threads: int | None, device: str) -> int | None:
    """``--torch-threads`` as the worker applies it (None: leave torch's
    default). Unset: 1 on a GPU worker, whose CPU ops are small (positions,
    ids, an image's bytes) and run beside the event loop, media threads and
    the engine's thread: each thread's OpenMP team of one per core spun
    between them (2B preset, H100 host with 16 cores, 64 clients: an encode
    call 10.7 ms with torch's 16 threads against 6.1 ms with 1, 36.0 against
    39.0 req/s; vLLM's workers cut it to 1 as well). A CPU worker keeps them:
    there torch's threads are the compute."""
    if torch_threads is None:
        return 1 if device.startswith("cuda") else None
    return torch_threads


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_memory(value: str) -> tuple[float | None, int | None]:
    """``--kv-cache-memory``: (a fraction of free memory, or None; bytes, or None)."""
    text = value.strip().upper().replace(" ", "")
    number = text.rstrip("KMGIB")
    unit = text[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"KV cache memory {value!r}: a fraction (0.5) or bytes (8GiB, 512MiB, 1000000)") from None
    if unit not in _UNITS:
        raise ValueError(f"KV cache memory {value!r}: unit {unit!r} is not one of B, KB, MB, GB, KiB, MiB, GiB")
    if not unit and 0 < amount <= 1:
        return amount, None
    if amount <= 1 or (not unit and amount != int(amount)):
        raise ValueError(f"KV cache memory {value!r}: a fraction in (0, 1], or bytes")
    return None, int(amount * _UNITS[unit])
