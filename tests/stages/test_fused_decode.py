"""Attention over the paged cache: each row reads its own blocks through
its table, nothing past its length, whatever lies in other blocks; the
masked forms (gathered blocks under a mask) against a row-by-row reference
in plain torch, and the Triton kernel
(stages/torch_engine/kernels/triton_decode.py) against them on CUDA, or
on the CPU through Triton's interpreter where it is installed and asked
for (``TRITON_INTERPRET=1``, triton and numpy < 2.4 on the path; not in
CI). And the batch decoder with each attention, in CUDA graphs on a GPU,
against the masked one."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.models import builtin_path
from stages.sampling import SamplingConfig
from stages.torch_engine.batch_decoder import BatchDecoder
from stages.torch_engine.decode_attention import masked_step, rows_step
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.fused_decode import RECOMPILE_LIMIT, FusedKernels, default_attention
from stages.torch_engine.settings import DecodeSettings


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def _reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: list[list[int]],
    lengths: list[int],
    scaling: float,
) -> torch.Tensor:
    """Row by row: its positions picked block by block, in float32."""
    b, heads, d = q.shape
    kv_heads, block_size = keys.shape[1], keys.shape[2]
    out = torch.empty(b, heads * d)
    for row, n in enumerate(lengths):
        picked = [(table[row][p // block_size], p % block_size) for p in range(n)]
        k = torch.stack([keys[blk, :, off] for blk, off in picked], dim=1).float()  # [kv, n, d]
        v = torch.stack([values[blk, :, off] for blk, off in picked], dim=1).float()
        k = k.repeat_interleave(heads // kv_heads, 0)
        v = v.repeat_interleave(heads // kv_heads, 0)
        probs = torch.softmax((q[row].float()[:, None, :] @ k.transpose(-1, -2)) * scaling, dim=-1)  # [heads, 1, n]
        out[row] = (probs @ v).reshape(heads * d)
    return out


@pytest.mark.parametrize(("heads", "kv_heads"), [(12, 2), (4, 4)])
def test_paged_attention_reads_each_rows_own_blocks(engine_device: str, heads: int, kv_heads: int) -> None:
    device, dtype = torch.device(engine_device), _dtype(engine_device)
    num_blocks, block_size, d, bucket, per_row = 40, 16, 64, 4, 8
    gen = torch.Generator().manual_seed(0)
    # Every block holds keys that would take every weight if read, and huge values.
    keys = torch.full((num_blocks, kv_heads, block_size, d), 50.0)
    values = torch.full((num_blocks, kv_heads, block_size, d), 1e3)
    lengths = [1, 17, 128, 40]
    # Each row's blocks, scattered through the pool; the table's rest is the null block.
    order = torch.randperm(num_blocks - 1, generator=gen)[: bucket * per_row] + 1
    table = [[int(b) for b in order[row * per_row : (row + 1) * per_row]] for row in range(bucket)]
    for row, n in enumerate(lengths):
        for p in range(n):
            blk, off = table[row][p // block_size], p % block_size
            keys[blk, :, off] = torch.randn(kv_heads, d, generator=gen)
            values[blk, :, off] = torch.randn(kv_heads, d, generator=gen)
        table[row] = table[row][: -(-n // block_size)] + [0] * (per_row - -(-n // block_size))
    q = torch.randn(bucket, heads, d, generator=gen)
    scaling = d**-0.5
    want = _reference(q, keys, values, table, lengths, scaling)
    keys, values, q = keys.to(device, dtype), values.to(device, dtype), q.to(device, dtype)
    tables = torch.tensor(table, device=device)
    write_at = torch.tensor([n - 1 for n in lengths], device=device)
    span = per_row * block_size
    tolerance: dict[str, Any] = {} if device.type == "cpu" else {"atol": 2e-2, "rtol": 2e-2}
    for attention in ("sdpa", "compiled"):
        got = FusedKernels(compile=False, attention=attention).attend(
            q, keys, values, masked_step(bucket, span, write_at, tables), scaling
        )
        assert got.shape == (bucket, heads * d) and float(got.abs().max()) < 10
        torch.testing.assert_close(got.float().cpu(), want, **tolerance)
    if device.type == "cuda" or _interpreted():
        if device.type == "cpu":  # the interpreter has no bfloat16
            keys, values, q = keys.half(), values.half(), q.half()
        # The counters the last program of each (row, kv head) combines by
        # are left at zero: the same buffer serves the next launch.
        counters = torch.zeros(bucket * kv_heads, dtype=torch.int32, device=device)
        kernels = FusedKernels(compile=False, attention="triton")
        for _ in range(3):
            triton = kernels.attend(q, keys, values, rows_step(bucket, write_at, tables, counters), scaling)
            torch.testing.assert_close(triton.float().cpu(), want, atol=2e-2, rtol=2e-2)
            assert not counters.any()


@pytest.mark.parametrize(("attention", "linear"), [("compiled", "cublas"), ("triton", "cublas"), ("triton", "triton")])
def test_each_attention_gives_the_sdpa_decoders_logits(
    mmpipe_home: Path, engine_device: str, attention: str, linear: str
) -> None:
    """Rows of different lengths, their blocks scattered, in CUDA graphs on
    a GPU; with the skinny Triton projections against cuBLAS's."""
    device = torch.device(engine_device)
    if "triton" in (attention, linear) and device.type != "cuda":
        pytest.skip("the Triton kernels run on CUDA only here")
    engine = TorchEngine(
        builtin_path("tiny-qwen2-vl"),
        device=engine_device,
        dtype=_dtype(engine_device),
        decode=DecodeSettings(batched=False),
    )
    decoders = []
    for kind, project in ((attention, linear), ("sdpa", "cublas")):
        decoder = BatchDecoder(engine.model, max_slots=4, max_len=256, use_graphs=True, fused=True, block_size=16)
        decoder.kernels = FusedKernels(compile=device.type == "cuda", attention=kind, linear=project)
        decoders.append(decoder)
    greedy = SamplingConfig(temperature=0.0, max_tokens=32, min_tokens=32)
    texts = ["Hi", "Tell me about the sea and the sky.", "1 2 3 4 5 6 7 8 9 10 11 12"]
    caches, lengths, tokens = [], [], []
    for text in texts:
        [(seq, first)] = engine.prefill([engine.tokenizer(text)["input_ids"]], [[]], [greedy])
        caches.append([(layer.keys, layer.values) for layer in seq.cache.layers])
        lengths.append(seq.length - 1)
        tokens.append(first)
        engine.release(seq)
    for decoder in decoders:
        decoder.pool.allocate(5)  # rows' blocks do not start at the pool's first
        for row, layers in enumerate(caches):
            blocks = decoder.pool.allocate(decoder.blocks_for(lengths[row] + 8))[::-1]  # and run backwards
            decoder.set_table(row, blocks)
            decoder.load(blocks, layers)
    for _ in range(6):
        other, masked = (d.step(tokens, lengths, lengths) for d in decoders)
        assert other.shape == (len(texts), engine.model.config.text_config.vocab_size)
        if device.type == "cpu":
            torch.testing.assert_close(other, masked, atol=1e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(other.float(), masked.float(), atol=5e-2, rtol=5e-2)
        tokens = masked.argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]


def test_the_projections_are_cublas_unless_asked() -> None:
    assert FusedKernels(compile=False).linear == "cublas"
    assert FusedKernels(compile=False, linear="triton").linear == "triton"
    with pytest.raises(ValueError, match="cublas or triton"):
        FusedKernels(compile=False, linear="cutlass")


# torch.compile's first use imports torch.utils.mkldnn, which warns of itself on the CPU wheel.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_pieces_may_compile_for_several_models_in_one_process() -> None:
    FusedKernels(compile=True)
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT >= 4 * 6


def test_the_default_attention_by_device_dtype_and_head_size() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    half = "triton" if importlib.util.find_spec("triton") is not None else "sdpa"
    assert default_attention(cuda, torch.bfloat16, 128) == half
    assert default_attention(cuda, torch.float16, 64) == half
    assert default_attention(cuda, torch.bfloat16, 80) == "sdpa"  # not a power of two: Triton's tl.arange
    assert default_attention(cuda, torch.float32, 128) == "sdpa"  # the kernel takes half precision only
    assert default_attention(cpu, torch.bfloat16, 128) == "sdpa"


def test_every_batch_sizes_graph_is_captured_at_start(mmpipe_home: Path, engine_device: str) -> None:
    """No batch size first seen under load stops the running ones to compile
    and capture: a decoding engine in half precision on a GPU has every
    graph before its first sequence (a CPU has none to capture)."""
    device = torch.device(engine_device)
    engine = TorchEngine(
        builtin_path("tiny-qwen2-vl"), device=engine_device, dtype=_dtype(engine_device), decode=DecodeSettings(slots=4)
    )
    assert engine.decoder is not None
    captured = set(engine.decoder._graphs)
    assert captured == ({(1, 0), (2, 0), (4, 0)} if device.type == "cuda" else set())
    greedy = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    prompt = engine.tokenizer("Count to three.")["input_ids"]
    running = []
    for _ in range(3):  # batches of 1, 2 and 3 (padded to 4)
        [(seq, _)] = engine.prefill([prompt], [[]], [greedy])
        running.append(seq)
        tokens = engine.step(running)
        assert len(tokens) == len(running) and all(0 <= t < engine.family.vocab_size for t in tokens)
    assert set(engine.decoder._graphs) == captured
    for seq in running:
        engine.release(seq)
