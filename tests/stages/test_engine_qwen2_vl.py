"""TorchEngine on tiny-qwen2-vl: greedy tokens equal transformers generate() exactly.

Uses tests/conftest.py's session fixtures mmpipe_home (a temporary MMPIPE_HOME),
tiny_model_dir (the built-in, built there once) and engine_device (the engine
and the reference on --engine-device; cpu by default).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from schemas.chunk import FinishReason
from schemas.errors import ContextLengthExceeded, InvalidRequest
from schemas.processed import MediaKind, ProcessedRequest
from schemas.request import ChatMessage, GenerateRequest, SamplingParams
from stages.emitter import ChunkEmitter
from stages.families import MediaEmbedding
from stages.sampling import SamplingConfig
from stages.torch_engine.batch_decoder import from_blocks, to_blocks
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.reference import load_reference_model, reference_generate
from stages.torch_engine.sampling import select_token, token_seed
from stages.torch_engine.sequence import KvState
from tests.stages.engine_helpers import decode, engine_on, greedy

N_NEW = 24


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir: Path) -> Path:
    # tests/conftest.py: builtin_path("tiny-qwen2-vl") under a temporary MMPIPE_HOME, once per session.
    return tiny_model_dir


@pytest.fixture(scope="session")
def engine(model_dir: Path, engine_device: str) -> TorchEngine:
    return engine_on(engine_device, model_dir)


@pytest.fixture(scope="session")
def ref_model(model_dir: Path, engine_device: str) -> Any:
    return load_reference_model(model_dir, device=engine_device)


@pytest.fixture(scope="session")
def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    # Two sizes: 300x200 -> grid 12x18 (54 tokens), 60x90 -> grid 6x4 (6 tokens).
    return [
        Image.fromarray(rng.integers(0, 256, (200, 300, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(0, 256, (90, 60, 3), dtype=np.uint8)),
    ]


def _prompt(engine: TorchEngine, n_images: int, text: str = "Describe what you see, please. 你好 😀") -> list[int]:
    content: list[dict[str, str]] = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
    )
    return list(ids)


@pytest.fixture(scope="session")
def cases(engine: TorchEngine, ref_model: Any, model_dir: Path, images: list[Image.Image]) -> dict[int, Any]:
    """n_images -> (prompt, images, reference tokens)."""
    out = {}
    for n in (0, 1, 2):
        prompt = _prompt(engine, n)
        out[n] = (prompt, images[:n], reference_generate(model_dir, prompt, images[:n], N_NEW, model=ref_model))
    return out


def test_engine_attributes(engine: TorchEngine) -> None:
    assert engine.eos_token_ids == frozenset({151645, 151643})
    assert engine.max_model_len == 4096
    assert engine.family.placeholder_ids == {MediaKind.IMAGE: 151655, MediaKind.VIDEO: 151656}
    assert engine.tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655


def test_encode_shapes(engine: TorchEngine, images: list[Image.Image]) -> None:
    encoded = engine.encode(images)
    assert [e.grid_thw for e in encoded] == [(1, 12, 18), (1, 6, 4)]
    assert [e.num_tokens for e in encoded] == [54, 6]
    assert all(e.embeddings.shape[1] == 64 for e in encoded)
    assert engine.encode([]) == []


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_greedy_matches_generate(engine: TorchEngine, cases: dict[int, Any], n_images: int) -> None:
    prompt, imgs, expected = cases[n_images]
    [(seq, first)] = engine.prefill([prompt], [engine.encode(imgs)], [greedy(N_NEW)])
    tokens = decode(engine, seq, first, N_NEW)
    assert tokens == expected
    assert seq.output_token_ids == expected and seq.num_generated == N_NEW
    assert seq.reached_max_tokens
    engine.release(seq)
    assert seq.released


def test_outputs_depend_on_images(cases: dict[int, Any]) -> None:
    # Guards the equality tests against a model that ignores its input.
    assert len({tuple(c[2]) for c in cases.values()}) == 3
    assert all(len(set(c[2])) > 3 for c in cases.values())


def test_batched_calls_match_generate(engine: TorchEngine, cases: dict[int, Any]) -> None:
    order = [2, 0, 1]
    prompts = [cases[n][0] for n in order]
    encoded = [engine.encode(cases[n][1]) for n in order]
    results = engine.prefill(prompts, encoded, [greedy(N_NEW)] * 3)
    seqs = [seq for seq, _ in results]
    outputs = [[tok] for _, tok in results]
    for _ in range(N_NEW - 1):
        for out, tok in zip(outputs, engine.step(seqs), strict=True):
            out.append(tok)
    assert outputs == [cases[n][2] for n in order]


@pytest.mark.parametrize(("n_images", "k"), [(2, 1), (2, 11), (0, 5), (1, N_NEW - 1)])
def test_resume_matches_generate(engine: TorchEngine, cases: dict[int, Any], n_images: int, k: int) -> None:
    prompt, imgs, expected = cases[n_images]
    [(seq, nxt)] = engine.prefill([prompt], [engine.encode(imgs)], [greedy(N_NEW)], emitted=[expected[:k]])
    assert seq.num_generated == k + 1
    assert decode(engine, seq, nxt, N_NEW - k) == expected[k:]


def test_positions_match_transformers_rope_index(
    engine: TorchEngine, ref_model: Any, cases: dict[int, Any], images: list[Image.Image]
) -> None:
    get_rope_index = ref_model.model.get_rope_index
    if "mm_token_type_ids" not in inspect.signature(get_rope_index).parameters:
        pytest.skip("get_rope_index of this transformers release has another signature")
    prompt = cases[2][0]
    encoded = engine.encode(images)
    ids = engine.family.expand_placeholders(prompt, encoded)
    positions, delta = engine.family.prompt_positions(ids, encoded)
    input_ids = torch.tensor([ids])
    ref_positions, ref_delta = get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == 151655).int(),
        image_grid_thw=torch.tensor([e.grid_thw for e in encoded]),
    )
    assert torch.equal(positions, ref_positions)
    assert delta == int(ref_delta) and delta < 0


def test_request_errors(engine: TorchEngine, cases: dict[int, Any], images: list[Image.Image]) -> None:
    prompt = cases[1][0]
    encoded = engine.encode(images)
    with pytest.raises(InvalidRequest, match="placeholders"):
        engine.prefill([prompt], [encoded], [greedy(N_NEW)])
    with pytest.raises(InvalidRequest, match="placeholders"):
        engine.prefill([cases[2][0]], [encoded[:1]], [greedy(N_NEW)])
    bad = MediaEmbedding(encoded[0].embeddings[:5], encoded[0].grid_thw)
    with pytest.raises(InvalidRequest, match="does not match"):
        engine.prefill([prompt], [[bad]], [greedy(N_NEW)])
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.prefill([[1, 2, 10**7]], [[]], [greedy(N_NEW)])
    with pytest.raises(ContextLengthExceeded):
        engine.prefill([[100] * 4096], [[]], [greedy(N_NEW)])
    with pytest.raises(InvalidRequest):
        SamplingConfig(temperature=-1.0)
    with pytest.raises(InvalidRequest):
        SamplingConfig(top_p=0.0)


def _sample(engine: TorchEngine, prompt: list[int], enc: list[MediaEmbedding], cfg: SamplingConfig) -> list[int]:
    [(seq, first)] = engine.prefill([prompt], [enc], [cfg])
    out = decode(engine, seq, first, cfg.max_tokens)
    engine.release(seq)
    return out


def test_sampling_reproducible_and_resumable(engine: TorchEngine, cases: dict[int, Any]) -> None:
    prompt, imgs, greedy_tokens = cases[1]
    enc = engine.encode(imgs)
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, top_k=200, seed=7, max_tokens=16, min_tokens=16)
    first = _sample(engine, prompt, enc, cfg)
    assert _sample(engine, prompt, enc, cfg) == first
    other = _sample(engine, prompt, enc, SamplingConfig(**{**cfg.__dict__, "seed": 8}))
    assert other != first
    assert first != greedy_tokens[:16]
    # A takeover that resumes at index 6 draws the same continuation.
    [(seq, nxt)] = engine.prefill([prompt], [enc], [cfg], emitted=[first[:6]])
    assert decode(engine, seq, nxt, 10) == first[6:]
    # top_k=1 is greedy whatever the temperature.
    top1 = SamplingConfig(temperature=1.5, top_k=1, seed=3, max_tokens=8, min_tokens=8)
    assert _sample(engine, prompt, enc, top1) == greedy_tokens[:8]


def test_select_token_rules() -> None:
    eos = torch.tensor([5, 6])
    logits = torch.zeros(10)
    logits[5] = 9.0
    logits[3] = 4.0
    greedy = SamplingConfig(min_tokens=2)
    assert select_token(logits, greedy, index=1, eos_token_ids=eos) == 3  # EOS masked below min_tokens
    assert select_token(logits, greedy, index=2, eos_token_ids=eos) == 5
    assert torch.equal(logits[5], torch.tensor(9.0))  # caller's logits untouched
    # Sampling: same (seed, index) -> same token; the draws vary with the index.
    cfg = SamplingConfig(temperature=1.0, seed=11)
    flat = torch.zeros(1000)
    assert select_token(flat, cfg, 4) == select_token(flat, cfg, 4)
    assert len({select_token(flat, cfg, i) for i in range(20)}) > 10
    assert token_seed(11, 4) != token_seed(11, 5) != token_seed(12, 4)
    # top_p keeps the smallest prefix reaching p: here only the top token.
    peaked = torch.tensor([0.0, 10.0, 0.0, 0.0])
    assert {select_token(peaked, SamplingConfig(temperature=1.0, top_p=0.5, seed=s), 0) for s in range(20)} == {1}
    # min_p: only tokens at least min_p as likely as the best (e^-1 of it at
    # 0.3: ids 0 and 1 of these) are drawn.
    graded = torch.tensor([2.0, 1.0, -3.0, -3.0, -3.0])
    assert {select_token(graded, SamplingConfig(temperature=1.0, min_p=0.3, seed=s), 0) for s in range(40)} == {0, 1}
    # A sampled request's stop_token_ids are masked below min_tokens, as EOS is.
    stops = SamplingConfig(temperature=1.0, min_tokens=2, stop_token_ids=(5,), seed=3)
    assert select_token(logits * 10, stops, index=1, eos_token_ids=torch.tensor([6])) != 5
    assert select_token(logits * 10, stops, index=2, eos_token_ids=torch.tensor([6])) == 5
    # The repetition penalty divides a positive logit of a prompt or an output
    # token and multiplies a negative one.
    penalty = SamplingConfig(repetition_penalty=2.0, prompt_ids=(0,))
    assert select_token(torch.tensor([3.0, 2.0, -1.0, -1.5]), penalty, 0, generated=[2]) == 1
    assert select_token(torch.tensor([-1.0, -4.0, -1.5, -3.0]), penalty, 0, generated=[3]) == 2


def test_stop_tokens(engine: TorchEngine) -> None:
    """The stop rule (the emitter's) on this engine's EOS ids, the generation
    config's list: either ends a request, another token does not, and
    ignore_eos keeps generating through them."""

    def emitter(ignore_eos: bool) -> ChunkEmitter:
        sampling = SamplingParams(max_tokens=4, ignore_eos=ignore_eos)
        request = GenerateRequest("r", "tiny", [ChatMessage("user", "x")], sampling)
        return ChunkEmitter(engine, ProcessedRequest(request, [1], [], ["prefill+decode"], 4, 0), 1, [])

    stops = emitter(ignore_eos=False)
    assert stops.is_eos(151645) and stops.is_eos(151643)
    assert not stops.is_eos(100)
    assert stops.push(151645).finish_reason is FinishReason.STOP
    assert emitter(ignore_eos=False).push(100).finish_reason is None
    assert not emitter(ignore_eos=True).is_eos(151645)
    assert emitter(ignore_eos=True).push(151645).finish_reason is None


@pytest.fixture(scope="session")
def decode_engine(model_dir: Path, engine_device: str) -> TorchEngine:
    # A second instance: what a decode worker in another process holds.
    return engine_on(engine_device, model_dir)


@pytest.mark.parametrize("n_images", [0, 2])
def test_kv_handed_to_another_engine_continues_like_generate(
    engine: TorchEngine, decode_engine: TorchEngine, cases: dict[int, Any], n_images: int
) -> None:
    prompt, imgs, expected = cases[n_images]
    [(seq, first)] = engine.prefill([prompt], [engine.encode(imgs)], [greedy(N_NEW)])
    tensors, state = engine.export_kv(seq)
    assert len(tensors) == 2 * engine.family.num_hidden_layers
    # In blocks, the prompt's positions (the first token is not in the cache yet).
    blocks, _, block_size, _ = tensors[0].shape
    assert state.output_ids == [first] and blocks == -(-state.prompt_len // block_size)
    # Over the wire the tensors are bytes: copies, not views of prefill's cache.
    received = [t.clone() for t in tensors]
    engine.release(seq)
    moved = decode_engine.import_kv(received, state, greedy(N_NEW))
    assert decode(decode_engine, moved, first, N_NEW) == expected
    # Without rope_delta the positions are wrong and so are the tokens.
    if n_images:
        shifted = KvState(state.prompt_len, state.output_ids, 0)
        wrong = decode_engine.import_kv([t.clone() for t in tensors], shifted, greedy(N_NEW))
        assert decode(decode_engine, wrong, first, N_NEW) != expected


def test_resume_after_a_hand_off_takes_the_clients_tokens(
    engine: TorchEngine, decode_engine: TorchEngine, cases: dict[int, Any]
) -> None:
    prompt, imgs, _ = cases[1]
    cfg = SamplingConfig(temperature=0.9, seed=21, max_tokens=12, min_tokens=12)
    reference = _sample(engine, prompt, engine.encode(imgs), cfg)
    [(seq, _)] = engine.prefill([prompt], [engine.encode(imgs)], [cfg])
    tensors, state = engine.export_kv(seq)
    moved = decode_engine.import_kv(tensors, state, cfg)
    # The client already holds 5 tokens from an earlier attempt.
    nxt = decode_engine.resume(moved, reference[:5])
    assert decode(decode_engine, moved, nxt, 7) == reference[5:]
    with pytest.raises(ValueError, match="disagree"):
        again = decode_engine.import_kv(tensors, state, cfg)
        decode_engine.step([again])
        decode_engine.resume(again, [reference[0] + 1, *reference[1:5]])


def test_import_checks_the_shape(engine: TorchEngine, decode_engine: TorchEngine, cases: dict[int, Any]) -> None:
    [(seq, _)] = engine.prefill([cases[0][0]], [[]], [greedy(N_NEW)])
    tensors, state = engine.export_kv(seq)
    with pytest.raises(InvalidRequest, match="layers"):
        decode_engine.import_kv(tensors[:2], state, greedy(N_NEW))
    block_size = tensors[0].shape[2]
    longer = KvState(state.prompt_len + block_size, state.output_ids, 0)  # a block more than was sent
    with pytest.raises(InvalidRequest, match="shape"):
        decode_engine.import_kv(tensors, longer, greedy(N_NEW))
    # Blocks of another size (another worker's --block-size) are taken as they come.
    length = state.prompt_len + len(state.output_ids) - 1
    halves = [to_blocks(from_blocks(t, length), block_size // 2) for t in tensors]
    a = decode_engine.import_kv(halves, state, greedy(N_NEW))
    b = decode_engine.import_kv(tensors, state, greedy(N_NEW))
    assert decode_engine.step([a]) == decode_engine.step([b])
    for s in (a, b, seq):
        (decode_engine if s is not seq else engine).release(s)
