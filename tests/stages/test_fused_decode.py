"""The fused step's unmasked attentions: each row reads its own keys of a
layer's whole cache, nothing past its length, and gives what the masked
attention gives. flash-attention's varlen kernel: on the CPU through
``varlen_reference`` (its contract in plain torch), on --engine-device cuda
the kernel in bf16. The Triton kernels
(stages/torch_engine/kernels/triton_decode.py): on CUDA only (Triton's CPU
interpreter, 3.5, fails under numpy 2.4). And the batch
decoder on either, in CUDA graphs on a GPU, against the masked one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from stages.models import builtin_path
from stages.sampling import SamplingConfig
from stages.torch_engine.batch_decoder import BatchDecoder
from stages.torch_engine.decode_attention import flash_varlen, masked_step, rows_step, varlen_reference, varlen_step
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.fused_decode import RECOMPILE_LIMIT, FusedKernels, default_attention
from stages.torch_engine.settings import DecodeSettings


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


@pytest.mark.parametrize(("heads", "kv_heads"), [(12, 2), (4, 4)])
def test_varlen_attention_reads_each_rows_own_keys(engine_device: str, heads: int, kv_heads: int) -> None:
    device, dtype = torch.device(engine_device), _dtype(engine_device)
    slots, max_len, d, bucket = 6, 64, 64, 4
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(slots, kv_heads, max_len, d, generator=gen)
    values = torch.randn(slots, kv_heads, max_len, d, generator=gen)
    q = torch.randn(bucket, heads, d, generator=gen)
    lengths = [1, 17, 64, 40]
    for row, n in enumerate(lengths):
        # Past a row's length: keys that would take every weight if read.
        keys[row, :, n:] = 50.0
        values[row, :, n:] = 1e3
    keys, values, q = keys.to(device, dtype), values.to(device, dtype), q.to(device, dtype)
    write_at = torch.tensor([n - 1 for n in lengths] + [0, 0], device=device)
    scaling = d**-0.5

    want = FusedKernels(compile=False, attention="sdpa").attend(
        q, keys, values, masked_step(bucket, max_len, write_at), scaling
    )
    step = varlen_step(bucket, write_at, kv_heads, max_len)
    assert step.seq_used is not None and step.seq_used.tolist() == [n for n in lengths for _ in range(kv_heads)]
    reference = FusedKernels(compile=False, attention="flash", varlen=varlen_reference)
    got = reference.attend(q, keys, values, step, scaling)
    assert got.shape == (bucket, heads * d) and float(got.abs().max()) < 10
    if device.type == "cpu":
        torch.testing.assert_close(got, want)
    else:
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    if device.type == "cuda":
        flash = FusedKernels(compile=False, attention="flash", varlen=flash_varlen).attend(
            q, keys, values, step, scaling
        )
        torch.testing.assert_close(flash, got, atol=2e-2, rtol=2e-2)
        # The counters the last program of each (row, kv head) combines by
        # are left at zero: the same buffer serves the next launch.
        counters = torch.zeros(bucket * keys.shape[1], dtype=torch.int32, device=device)
        kernels = FusedKernels(compile=False, attention="triton")
        for _ in range(3):
            triton = kernels.attend(q, keys, values, rows_step(bucket, write_at, counters), scaling)
            torch.testing.assert_close(triton, got, atol=2e-2, rtol=2e-2)
            assert not counters.any()


@pytest.mark.parametrize(("attention", "linear"), [("flash", "cublas"), ("triton", "cublas"), ("triton", "triton")])
def test_the_unmasked_decoder_gives_the_masked_decoders_logits(
    mmpipe_home: Path, engine_device: str, attention: str, linear: str
) -> None:
    """Rows of different lengths, in CUDA graphs on a GPU; with the skinny
    Triton projections against cuBLAS's."""
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
        decoder = BatchDecoder(engine.model, max_slots=4, max_len=256, use_graphs=True, fused=True)
        varlen = flash_varlen if device.type == "cuda" else varlen_reference
        decoder.kernels = FusedKernels(compile=device.type == "cuda", attention=kind, varlen=varlen, linear=project)
        decoders.append(decoder)
    greedy = SamplingConfig(temperature=0.0, max_tokens=32, min_tokens=32)
    texts = ["Hi", "Tell me about the sea and the sky.", "1 2 3 4 5 6 7 8 9 10 11 12"]
    caches, lengths, tokens = [], [], []
    for text in texts:
        [(seq, first)] = engine.prefill([engine.tokenizer(text)["input_ids"]], [[]], [greedy])
        layers, _ = engine.export_kv(seq)
        caches.append([(layers[2 * i], layers[2 * i + 1]) for i in range(len(layers) // 2)])
        lengths.append(layers[0].shape[2])
        tokens.append(first)
        engine.release(seq)
    for slot, layers in enumerate(caches):
        for decoder in decoders:
            decoder.load(slot, layers)
    for _ in range(6):
        unmasked, masked = (d.step(tokens, lengths, lengths) for d in decoders)
        assert unmasked.shape == (len(texts), engine.model.config.text_config.vocab_size)
        if device.type == "cpu":
            torch.testing.assert_close(unmasked, masked, atol=1e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(unmasked.float(), masked.float(), atol=5e-2, rtol=5e-2)
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
    half = "triton" if importlib.util.find_spec("triton") is not None else "flash"
    assert default_attention(cuda, torch.bfloat16, 128) == half
    assert default_attention(cuda, torch.float16, 64) == half
    assert default_attention(cuda, torch.bfloat16, 80) == "flash"  # not a power of two: Triton's tl.arange
    assert default_attention(cuda, torch.float32, 128) == "sdpa"  # neither kernel takes float32
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
