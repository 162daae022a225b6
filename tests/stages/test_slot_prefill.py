"""The graphed prefill straight into blocks of the decoder's pool (stages/torch_engine/slot_prefill.py):
the modules' logits and cache, M-RoPE positions of an image included, and
the modules still for what it does not take. On the CPU in float32 without
graphs (run eagerly, so CI checks the arithmetic); with --engine-device cuda
in bf16 under CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from schemas.processed import MediaKind
from schemas.request import ChatMessage, GenerateRequest, SamplingParams
from stages.contract import HopContext
from stages.hop import HopStage
from stages.models import builtin_path, resolve_model
from stages.models.traits import load_traits
from stages.processor import Processor
from stages.sampling import SamplingConfig
from stages.torch_engine.batch_decoder import from_blocks
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.hop_engine import TorchHopEngine
from stages.torch_engine.settings import DecodeSettings
from stages.torch_engine.slot_prefill import SlotPrefill
from tests.e2e.conftest import gradient


def _engine(device: str, **settings: int) -> TorchEngine:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    decode = DecodeSettings(slots=4, fused=True, **settings)  # type: ignore[arg-type]
    return TorchEngine(builtin_path("tiny-qwen2-vl"), device=device, dtype=dtype, decode=decode)


def _close(got: torch.Tensor, want: torch.Tensor, device: str, atol: float = 5e-2) -> None:
    if device == "cpu":
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=5e-2)


@pytest.mark.parametrize(("with_image", "words"), [(False, 0), (True, 0), (True, 260)])
def test_the_slot_prefill_gives_the_modules_logits_and_cache(
    mmpipe_home: Path, engine_device: str, with_image: bool, words: int
) -> None:
    engine = _engine(engine_device)
    prefill, decoder = engine._slot_prefill, engine.decoder
    assert prefill is not None and decoder is not None
    assert bool(prefill._graphs) == (engine_device != "cpu")  # captured at start on a GPU
    fam = engine.family
    filler = " ".join(["word"] * words)
    prompt = engine.tokenizer(f"Describe the picture in three words, please. {filler}")["input_ids"]
    media = []
    if with_image:
        media = engine.encode([gradient(60, 44, 3)])
        prompt = [fam.placeholder_ids[MediaKind.IMAGE], *prompt]
    ids, positions, _ = engine._prepare(prompt, media, [])
    assert with_image == bool((positions[0] != positions[1]).any())  # M-RoPE rows differ over the image
    n = len(ids)
    if n > 128:
        # Padded by under a quarter (the rows past the prompt are a GPU's work for nothing).
        assert prefill.bucket_for(n) - n < n / 4, (n, prefill.bucket_for(n))
    # Blocks scattered through the pool, backwards: the prompt's, and none of the others written.
    blocks = list(range(3, 3 + 2 * decoder.blocks_for(n), 2))[::-1]
    with torch.inference_mode():
        embeds = fam.embed_prompt(engine.model, ids, media)
        want, cache = fam.forward(engine.model, positions, None, inputs_embeds=embeds)
        decoder.keys.fill_(7.0)  # whatever the blocks held before
        got = prefill.run(embeds[0], positions, blocks)
    _close(got, want, engine_device)
    for i, layer in enumerate(cache.layers):
        _close(from_blocks(decoder.keys[i, blocks], n), layer.keys[0], engine_device)
        _close(from_blocks(decoder.values[i, blocks], n), layer.values[0], engine_device)
    others = [b for b in range(1, decoder.pool.num_blocks) if b not in blocks]
    assert bool((decoder.keys[:, others] == 7.0).all())  # no other block written


@pytest.mark.parametrize(("with_image", "prefix_blocks"), [(False, 1), (True, 2), (True, 9)])
def test_past_a_cached_prefix_the_slot_prefill_gives_the_modules_logits_and_cache(
    mmpipe_home: Path, engine_device: str, with_image: bool, prefix_blocks: int
) -> None:
    """A prompt whose first blocks hold a cached prefix: the rest's rows
    attend over those blocks and each other through the prompt's table
    (on a GPU in bf16 the Triton decode kernel, one row per token, under a
    graph), and give the whole prompt's logits and cache as the modules do;
    the prefix's blocks are read, not written, and no other block either."""
    engine = _engine(engine_device)
    prefill, decoder = engine._slot_prefill, engine.decoder
    assert prefill is not None and decoder is not None and prefill.past
    if engine_device != "cpu":
        assert {(bucket, True, 0) for bucket in prefill.buckets} <= set(prefill._graphs)
    fam = engine.family
    prompt = engine.tokenizer("Describe the picture in three words, please. " + " ".join(["word"] * 140))["input_ids"]
    media = []
    if with_image:
        media = engine.encode([gradient(60, 44, 3)])
        prompt = [fam.placeholder_ids[MediaKind.IMAGE], *prompt]
    ids, positions, _ = engine._prepare(prompt, media, [])
    n, start = len(ids), prefix_blocks * decoder.block_size
    assert start < n and prefill.fits(n - start)
    blocks = list(range(3, 3 + 2 * decoder.blocks_for(n), 2))[::-1]
    with torch.inference_mode():
        embeds = fam.embed_prompt(engine.model, ids, media)
        want, cache = fam.forward(engine.model, positions, None, inputs_embeds=embeds)
        decoder.keys.fill_(7.0)
        prefill.run(embeds[0, :start], positions[..., :start], blocks[:prefix_blocks])
        prefix = decoder.keys[:, blocks[:prefix_blocks]].clone(), decoder.values[:, blocks[:prefix_blocks]].clone()
        got = prefill.run(embeds[0, start:], positions[..., start:], blocks, start=start)
    # On a GPU the Triton kernel's float32 softmax against the modules' bf16
    # SDPA: a few logits in a thousand part by up to 0.11 (of values to 18).
    atol = 0.2
    _close(got, want, engine_device, atol)
    assert torch.equal(decoder.keys[:, blocks[:prefix_blocks]], prefix[0])
    assert torch.equal(decoder.values[:, blocks[:prefix_blocks]], prefix[1])
    for i, layer in enumerate(cache.layers):
        _close(from_blocks(decoder.keys[i, blocks], n), layer.keys[0], engine_device, atol)
        _close(from_blocks(decoder.values[i, blocks], n), layer.values[0], engine_device, atol)
    others = [b for b in range(1, decoder.pool.num_blocks) if b not in blocks]
    assert bool((decoder.keys[:, others] == 7.0).all())
    with pytest.raises(ValueError, match="prefix of 3 tokens"):
        prefill.run(embeds[0, 3:], positions[..., 3:], blocks, start=3)  # not whole blocks


def test_a_chunk_past_the_first_runs_padded_over_a_power_of_two_span_as_its_graph_does(
    mmpipe_home: Path, engine_device: str
) -> None:
    """A long prompt's chunks past the first replay one graph per span: the
    rows padded to the chunk length's bucket, attention over the table's
    first span positions (a power of two blocks, past the prompt's own). That
    form, run eagerly here (what each graph captures), gives the unpadded
    chunk's logits and the modules' cache, and its padding rows write no
    block but the null one. On a GPU ``run`` replays the graphs captured at
    start."""
    engine = _engine(engine_device, max_num_batched_tokens=40, max_len=512)
    prefill, decoder = engine._slot_prefill, engine.decoder
    assert prefill is not None and decoder is not None
    assert prefill.chunk_tokens == 32  # the budget in whole blocks
    assert prefill.chunk_spans() == [64, 128, 256, 512]
    if engine_device != "cpu":
        assert {(32, True, span) for span in prefill.chunk_spans()} <= set(prefill._graphs)
    fam = engine.family
    prompt = engine.tokenizer(" ".join(f"word{i}" for i in range(60)))["input_ids"][:72]
    ids, positions, _ = engine._prepare(prompt, [], [])
    n = len(ids)
    assert n == 72  # chunks of 32, 32 and 8
    blocks = list(range(3, 3 + 2 * decoder.blocks_for(n), 2))[::-1]
    with torch.inference_mode():
        embeds = fam.embed_prompt(engine.model, ids, [])
        want, cache = fam.forward(engine.model, positions, None, inputs_embeds=embeds)
        decoder.keys.fill_(7.0)
        for start in (0, 32):
            prefill.run(embeds[0, start : start + 32], positions[..., start : start + 32], blocks, start, chunk=True)
        got = prefill.run(embeds[0, 64:], positions[..., 64:], blocks, start=64, chunk=True)
        bucket, span = prefill.chunk_form(8, 64)
        assert (bucket, span) == (32, 128) and span > len(blocks) * decoder.block_size
        # run() left the last chunk's inputs in the static buffers, as a replay reads them.
        padded = prefill._forward(bucket, True, span).clone()
        unpadded = prefill._forward(prefill.bucket_for(8), True, decoder.blocks_for(n) * decoder.block_size)
    _close(got, want, engine_device, atol=0.2)
    _close(padded, unpadded, engine_device)
    _close(padded, want, engine_device, atol=0.2)
    for i, layer in enumerate(cache.layers):
        _close(from_blocks(decoder.keys[i, blocks], n), layer.keys[0], engine_device, atol=0.2)
        _close(from_blocks(decoder.values[i, blocks], n), layer.values[0], engine_device, atol=0.2)
    others = [b for b in range(1, decoder.pool.num_blocks) if b not in blocks]
    assert bool((decoder.keys[:, others] == 7.0).all())
    with pytest.raises(ValueError, match="chunks take up to 32"):
        prefill.chunk_form(33, 64)


def test_a_prompt_with_a_cached_prefix_prefills_its_rest_into_its_slot_and_decodes_the_modules_tokens(
    mmpipe_home: Path, engine_device: str
) -> None:
    """The engine takes a prompt that starts as an earlier one straight into
    its slot past the cached blocks (no cache read out of the pool and
    written back): the same tokens as the modules' prefill of the whole
    prompt (on a GPU the first: bf16 rounds differently in the last bits)."""
    graphed, modules = _engine(engine_device), _engine(engine_device, graph_prefill_len=0)
    greedy = SamplingConfig(temperature=0.0, max_tokens=10, min_tokens=10)
    first = graphed.tokenizer("Tell me about the sea " * 12)["input_ids"]
    longer = first + graphed.tokenizer(" and the mountains too", add_special_tokens=False)["input_ids"]
    runs = []
    for engine in (graphed, modules):
        [(seq, _)] = engine.prefill([first], [[]], [greedy])
        engine.step([seq])  # the modules' cache goes into blocks (and the cache) as it joins the batch
        engine.release(seq)
        [(seq, token)] = engine.prefill([longer], [[]], [greedy])
        assert seq.cached_tokens == len(first) // 16 * 16
        assert (seq.slot >= 0 and seq.cache is None) == (engine is graphed)
        tokens = [token]
        while len(tokens) < 10:
            tokens += engine.step([seq])
        engine.release(seq)
        runs.append(tokens)
    assert runs[0] == runs[1] if engine_device == "cpu" else runs[0][:1] == runs[1][:1]


def test_a_prefilled_slot_decodes_the_modules_tokens_and_a_long_prompt_takes_the_modules(
    mmpipe_home: Path, engine_device: str
) -> None:
    graphed, modules = _engine(engine_device, graph_prefill_len=32), _engine(engine_device, graph_prefill_len=0)
    assert modules._slot_prefill is None
    greedy = SamplingConfig(temperature=0.0, max_tokens=12, min_tokens=12)
    prompt = graphed.tokenizer("Count from one to ten:")["input_ids"]
    runs = []
    for engine in (graphed, modules):
        [(seq, first)] = engine.prefill([prompt], [[]], [greedy])
        assert (seq.slot >= 0 and seq.cache is None) == (engine is graphed)  # straight into its blocks
        tokens = [first]
        while len(tokens) < 12:
            tokens += engine.step([seq])
        engine.release(seq)
        runs.append(tokens)
    if engine_device == "cpu":
        assert runs[0] == runs[1]
    else:
        assert runs[0][:1] == runs[1][:1]  # bf16 rounds differently in the last bits: the first token
    long_prompt = graphed.tokenizer(" ".join(["word"] * 40))["input_ids"]
    assert len(long_prompt) > 32
    [(seq, _)] = graphed.prefill([long_prompt], [[]], [greedy])
    assert seq.cache is not None and seq.slot < 0  # longer than the largest bucket: the modules
    graphed.release(seq)


def test_a_role_that_ends_at_prefill_prefills_into_blocks_and_hands_them_off(
    mmpipe_home: Path, engine_device: str
) -> None:
    """A prefill-only engine keeps the decoder's pool only to prefill into
    (no decode graphs); the cache it exports from its blocks decodes to the
    same tokens in another engine."""
    prefill = _engine(engine_device, decodes=False)  # type: ignore[arg-type]
    assert prefill.decoder is not None and prefill._slot_prefill is not None
    assert not prefill.decoder._graphs  # nothing captured for steps it never takes
    cpu_modules = TorchEngine(
        builtin_path("tiny-qwen2-vl"), device="cpu", decode=DecodeSettings(batched=True, decodes=False)
    )
    assert cpu_modules.decoder is None  # no fused step here: no pool to prefill into
    decode = _engine(engine_device)
    greedy = SamplingConfig(temperature=0.0, max_tokens=10, min_tokens=10)
    prompt = prefill.tokenizer("Count from one to ten:")["input_ids"]
    [(seq, first)] = prefill.prefill([prompt], [[]], [greedy])
    assert seq.slot >= 0
    tensors, state = prefill.export_kv(seq)
    prefill.release(seq)
    moved = decode.import_kv(tensors, state, greedy)
    tokens = [first]
    while len(tokens) < 10:
        tokens += decode.step([moved])
    decode.release(moved)
    [(alone, token)] = decode.prefill([prompt], [[]], [greedy])
    expected = [token]
    while len(expected) < 10:
        expected += decode.step([alone])
    decode.release(alone)
    assert tokens == expected if engine_device == "cpu" else tokens[:1] == expected[:1]


@pytest.mark.parametrize("graph_prefill_len", [32, 0])
def test_a_deferred_prefill_token_is_settled_to_the_token_waited_for(
    mmpipe_home: Path, engine_device: str, graph_prefill_len: int
) -> None:
    """prefill(defer=True) on a GPU leaves the greedy token on its way to
    the host. A sequence prefilled into its slot can take steps before then
    (``launch``): the first is fed that token from the device, and
    ``collect`` settles it before the step's own; one prefilled through the
    modules cannot, and ``step`` settles it first. Either way the tokens
    are those of a prefill that waited. On the CPU it waits as before."""
    engine = _engine(engine_device, graph_prefill_len=graph_prefill_len)
    greedy = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    prompt = engine.tokenizer("Count from one to ten:")["input_ids"]
    runs = []
    for defer in (False, True):
        [(seq, first)] = engine.prefill([prompt], [[]], [greedy], defer=defer)
        assert (seq.slot >= 0) == (graph_prefill_len > 0)
        tokens: list[int] = []
        if defer and engine_device != "cpu":
            assert first == -1 and seq.pending is not None and seq.output_ids == []
            with pytest.raises(ValueError, match="not settled"):
                engine.export_kv(seq)
            if graph_prefill_len:
                # Two steps queued before anyone waits for the prefill's token.
                launches = [engine.launch([seq]), engine.launch([seq])]
                assert all(launch is not None for launch in launches)
                second = [engine.collect(launch)[0] for launch in launches if launch is not None]
                assert seq.pending is None and seq.output_ids[1:] == second
                tokens = [engine.settle(seq), *second]  # settled by collect: the same token again
            else:
                with pytest.raises(ValueError, match="not settled"):
                    engine.launch([seq])
                tokens = engine.step([seq])  # settles it first
                tokens = [seq.output_ids[0], *tokens]
        else:
            assert seq.pending is None and seq.output_ids == [first]
            assert engine.settle(seq) == first  # settled once; asking again is the same token
            tokens = [first]
        while len(tokens) < 8:
            tokens += engine.step([seq])
        engine.release(seq)
        runs.append(tokens)
    assert runs[0] == runs[1]
    assert engine.decoder is not None and len(engine.decoder._free_cells) == engine.decoder.max_slots  # none kept


async def test_the_decode_batch_takes_a_sequence_before_its_first_token_reaches_the_host(
    mmpipe_home: Path, engine_device: str
) -> None:
    """Through the hop, on a GPU: a prompt prefilled into its slot joins the
    decode loop's next step as its first token is still on its way to the
    host (fed from the device), and streams the tokens of the engine alone;
    on the CPU it joins once its token is in, as before."""
    engine = _engine(engine_device)
    stage = HopStage("encode+prefill+decode", TorchHopEngine("encode+prefill+decode", engine), "tiny")
    processor = Processor(load_traits(resolve_model(str(builtin_path("tiny-qwen2-vl")), "tiny")))
    requests = [
        processor.process(
            GenerateRequest(
                f"early-{i}",
                "tiny",
                [ChatMessage("user", f"Count to {i}, slowly.")],
                SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0),
            )
        )
        for i in range(3)
    ]
    await stage.start()
    try:
        streamed, contexts = [], []
        for req in requests:  # one at a time: each a batch of one, as the engine alone runs it
            ctx = HopContext()
            streamed.append([t async for chunk in stage.run(req, ctx) for t in chunk.token_ids])  # type: ignore[union-attr]
            contexts.append(ctx)
    finally:
        await stage.close()
    greedy = SamplingConfig(temperature=0.0, max_tokens=8, min_tokens=8)
    for req, tokens, ctx in zip(requests, streamed, contexts, strict=True):
        [(seq, first)] = engine.prefill([req.prompt_token_ids], [[]], [greedy])
        expected = [first]
        while len(expected) < 8:
            expected += engine.step([seq])
        engine.release(seq)
        assert tokens == expected
        assert ctx.trace.get("joined_early") == (1.0 if engine_device != "cpu" else None)


def test_the_compiled_prefill_gives_the_uncompiled_ones_logits_and_cache(mmpipe_home: Path, engine_device: str) -> None:
    """The layer pieces through torch.compile (on a GPU by default,
    --torch-compile) round where the modules round: in bf16 the same logits
    and cache as uncompiled, bit for bit on the CPU (fused kernels that kept
    float32 between ops parted by 0.23), within bf16 rounding on a GPU."""
    decode = DecodeSettings(slots=4, fused=True, graph_prefill_len=64, torch_compile=False)
    engine = TorchEngine(builtin_path("tiny-qwen2-vl"), device=engine_device, dtype=torch.bfloat16, decode=decode)
    decoder = engine.decoder
    assert decoder is not None
    compiled = SlotPrefill(decoder, use_graphs=False, longest=64, compiled=True)
    eager = SlotPrefill(decoder, use_graphs=False, longest=64, compiled=False)
    prompt = engine.tokenizer("Describe the picture in three words, please.")["input_ids"]
    ids, positions, _ = engine._prepare(prompt, [], [])
    blocks = list(range(1, 1 + decoder.blocks_for(len(ids))))
    with torch.inference_mode():
        embeds = engine.family.embed_prompt(engine.model, ids, [])[0]
        want = eager.run(embeds, positions, blocks)
        want_keys = decoder.keys[:, blocks].clone()
        decoder.keys.zero_()
        got = compiled.run(embeds, positions, blocks)
    exact = {"atol": 0, "rtol": 0} if engine_device == "cpu" else {"atol": 5e-2, "rtol": 5e-2}
    torch.testing.assert_close(got.float(), want.float(), **exact)
    torch.testing.assert_close(decoder.keys[:, blocks].float(), want_keys.float(), **exact)
